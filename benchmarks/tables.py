"""Table helpers the suites share (``wtransfer bench`` needs none of them, so they stay out of the wheel)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wtransfer._bench.report import MarkdownTable


def median_item(items: list[Any], key: Callable[[Any], float]) -> Any:
    """The item whose ``key`` is the median (the lower middle one for an even count): a run that really happened
    stands for its set."""
    return sorted(items, key=key)[(len(items) - 1) // 2]


def table(title: str, columns: list[str], rows: list[list[str]]) -> list[str]:
    made = MarkdownTable(title)
    for column in columns:
        made.add_column(column)
    for row in rows:
        made.add_row(*row)
    return made.lines()


def ratio_rows(figures: dict[str, Any], directions: tuple[str, ...], baseline: str, ours: str) -> list[list[str]]:
    """One row per measured direction: the baseline's and our GB/s, the ratio, target and verdict."""
    return [
        [direction, f"{f[baseline]:.2f}", f"{f[ours]:.2f}", f"{f['ratio']:.2f}×",
         f">= {f['target']}× {'ok' if f['ok'] else 'MISSED'}"]
        for direction, f in ((d, figures[d]) for d in directions if d in figures)
    ]
