"""How a suite reports: tables for people, ``--json`` for programs, ``--markdown`` for BENCHMARKS.md.

A suite prints human-readable lines as it measures and records its figures in a dict. ``--json``: the lines go to
stderr, the dict to stdout. ``--markdown``: the dict rendered as a Markdown block naming the machine and the command;
``--markdown FILE`` replaces that block between its markers in FILE (BENCHMARKS.md's figures are never typed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from wtransfer.testing.bench_blocks import markdown_block, markdown_table, replace_block

Renderer = Callable[[dict[str, Any]], list[str]]


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout (lines go to stderr)")
    parser.add_argument(
        "--markdown", nargs="?", const="-", default=None, metavar="FILE",
        help="a Markdown block of the figures: printed, or written between its markers in FILE (e.g. BENCHMARKS.md)",
    )
    parser.add_argument("--markdown-block", default=None, metavar="NAME",
                        help="the block's name in FILE (None: the suite's name)")


@contextlib.contextmanager
def figures_report(args: argparse.Namespace, suite: str, render: Renderer) -> Iterator[dict[str, Any]]:
    """The dict a suite records its figures in; reported as ``args`` asks when the suite is done."""
    figures: dict[str, Any] = {}
    if not args.json and args.markdown is None:
        yield figures
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield figures
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    name = args.markdown_block or suite
    block = markdown_block(name, getattr(args, "command_line", f"wtransfer bench {suite}"), render(figures))
    if args.markdown == "-":
        print(block)
    else:
        replace_block(Path(args.markdown), name, block)
        print(f"wrote the {name!r} block of {args.markdown}", file=sys.stderr)


# -- Markdown ---------------------------------------------------------------------------------
class MarkdownTable:
    """The slice of ``rich.table.Table`` the suites use, rendered as a Markdown table."""

    def __init__(self, title: str = "") -> None:
        self.title = title
        self.columns: list[str] = []
        self.rows: list[list[str]] = []

    def add_column(self, name: str, **_rich_options: Any) -> None:  # no_wrap and the like: Markdown never cuts
        self.columns.append(name)

    def add_row(self, *cells: str) -> None:
        from rich.text import Text

        self.rows.append([Text.from_markup(str(cell)).plain for cell in cells])

    def lines(self) -> list[str]:
        return markdown_table(self.title, self.columns, self.rows)


class MarkdownLines:
    """A console stand-in that collects tables and lines (rich markup stripped) as Markdown."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, item: Any = "") -> None:
        from rich.text import Text

        if self.lines:
            self.lines.append("")
        if isinstance(item, MarkdownTable):
            self.lines.extend(item.lines())
        else:
            self.lines.append(Text.from_markup(str(item)).plain)
