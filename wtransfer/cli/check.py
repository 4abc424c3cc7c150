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
    from wtransfer._registry.manager import hook_plugins
    from wtransfer._registry.registry import registry_for

    rows: list[dict[str, Any]] = []
    for kind in KINDS.values():
        registry = registry_for(kind)
        for info, ref in registry.entries():
            row = info.to_dict()
            row["problem"] = None
            if info.status == "disabled":
                row["problem"] = "disabled by WTRANSFER_DISABLE_PLUGINS"
            else:
                try:
                    ref.load()
                    row["status"] = "conflict" if info.status == "conflict" else "ok"
                except WTransferError as exc:
                    row["status"], row["problem"] = "broken", str(exc)
                if info.status == "conflict":
                    row["problem"] = f"name {info.name!r} has several providers; use a qualified name"
            rows.append(row)
    for plugin in hook_plugins():
        rows.append({
            "kind": "hook plugin",
            "name": plugin.record.name,
            "distribution": plugin.record.distribution,
            "version": plugin.record.version,
            "target": plugin.record.value,
            "status": "ok" if plugin.status == "loaded" else plugin.status,
            "problem": plugin.error,
        })
    return rows


def run(args: argparse.Namespace) -> int:
    rows = collect()
    failed = any(row["status"] in ("broken", "conflict") for row in rows)
    if args.json:
        print_json(rows)
    else:
        print_table(
            "wtransfer check",
            ("kind", "name", "provider", "status", "problem"),
            [
                (r["kind"], r["name"], f"{r['distribution']} {r['version']}" if r["distribution"] else "(runtime)",
                 r["status"], r["problem"] or "")
                for r in rows
            ],
        )
        print("FAILED: fix or disable the components above." if failed else "All components load.")
    return 1 if failed else 0
