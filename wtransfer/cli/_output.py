"""Shared output helpers for the CLI: rich tables on a terminal, plain text otherwise."""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Sequence
from typing import Any


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    whole: Collection[str] = (),
) -> None:
    """A table that rich draws, as wide as the terminal (160 columns when stdout is not one).

    Columns in ``whole`` (what a user copies or greps for) are never wrapped or cut, the others fold to fit; when the
    whole columns alone do not fit, the table grows wider than the terminal."""
    from rich.cells import cell_len
    from rich.console import Console
    from rich.table import Table

    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    table = Table(title=title, show_lines=False, header_style="bold")
    minimum = len(columns) + 1  # the vertical borders
    for index, column in enumerate(columns):
        widest = max([cell_len(column)] + [cell_len(line) for row in cells for line in row[index].splitlines()])
        if column in whole:
            table.add_column(column, no_wrap=True, overflow="ignore", min_width=widest)
            minimum += widest + 2  # a space of padding each side
        else:
            table.add_column(column, overflow="fold")
            minimum += min(widest, max(cell_len(column), 24)) + 2
    for row in cells:
        table.add_row(*row)
    width = Console().width if sys.stdout.isatty() else 160
    Console(width=max(width, minimum)).print(table)


def _kind_choices() -> tuple[str, ...]:
    """Plural and singular names of every kind, from the kinds' data (a new kind needs no CLI edit)."""
    from wtransfer._registry.kinds import KINDS

    return tuple(k.name for k in KINDS.values()) + tuple(k.singular for k in KINDS.values())


KIND_CHOICES = _kind_choices()
