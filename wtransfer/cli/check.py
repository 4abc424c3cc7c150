"""``wtransfer check [--json]``: load everything, report what is broken, conflicting or disabled."""

from __future__ import annotations

import argparse
from typing import Any

from wtransfer.cli._output import print_json, print_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("check", help="load every component and hook plugin; exit 1 if any is broken")
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    parser.set_defaults(func=run)


def collect() -> list[dict[str, Any]]:
    """One row per component and hook plugin: status ok / broken / conflict / disabled."""
    from wtransfer.errors import WTransferError
    from wtransfer._registry.kinds import KINDS
    from wtransfer._registry.registry import registry_for
    from wtransfer.cli.listing import DISABLED, hook_plugin_rows

    rows: list[dict[str, Any]] = []
    for kind in KINDS.values():
        entries = registry_for(kind).entries()
        for info, ref in entries:
            row = info.to_dict()
            row["problem"] = None
            if info.status == "disabled":
                row["problem"] = DISABLED
            else:
                # A provider that cannot be loaded says why, whatever shares its name; "conflict" is for rows
                # that load and are ambiguous only.
                try:
                    ref.load()
                except WTransferError as exc:
                    row["status"], row["problem"] = "broken", str(exc)
                else:
                    row["status"] = "ok"
                    if info.status == "conflict":
                        row["status"], row["problem"] = "conflict", _conflict(info, entries)
            rows.append(row)
    for row in hook_plugin_rows():
        if row["status"] == "loaded":
            row["status"] = "ok"
        elif row["status"] == "disabled":
            row["problem"] = DISABLED
        rows.append(row)
    return rows


def _conflict(info: Any, entries: list[tuple[Any, Any]]) -> str:
    rivals = [ref.qualified_name for other, ref in entries if other.name == info.name and other.status == "conflict"]
    return f"name {info.name!r} has several providers; use a qualified name: {', '.join(rivals)}"


def run(args: argparse.Namespace) -> int:
    rows = collect()
    failed = any(row["status"] in ("broken", "conflict") for row in rows)
    if args.json:
        print_json(rows)
    else:
        from wtransfer._registry.names import qualify

        print_table(
            "wtransfer check",
            ("kind", "qualified name", "provider", "status", "problem"),
            [
                (r["kind"], qualify(r["distribution"], r["name"]),
                 f"{r['distribution']} {r['version']}" if r["distribution"] else "(runtime)",
                 r["status"], r["problem"] or "")
                for r in rows
            ],
            whole=("qualified name", "provider"),
        )
        print("FAILED: fix or disable the components above." if failed else "All components load.")
    return 1 if failed else 0
