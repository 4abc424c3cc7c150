"""Shared output helpers for the CLI: rich tables on a terminal, plain text otherwise."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table; rich draws it, wrapping only when stdout is a narrow terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) for cell in row))
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)


KIND_CHOICES = ("engines", "connectors", "specs", "engine", "connector", "spec")
