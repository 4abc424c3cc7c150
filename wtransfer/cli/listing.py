"""``wtransfer list [KIND] [--json]``: what is installed, from metadata only (imports no plugin)."""

from __future__ import annotations

import argparse

from wtransfer.cli._output import KIND_CHOICES, print_json, print_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("list", help="list engines, connectors and specs (imports no plugin)")
    parser.add_argument("kind", nargs="?", choices=KIND_CHOICES, help="only this kind")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wtransfer._registry.registry import list_components

    infos = list_components(args.kind)
    if args.json:
        print_json([info.to_dict() for info in infos])
        return 0
    rows = [
        (i.kind, i.name, f"{i.distribution} {i.version}" if i.distribution else "(runtime)", i.target, i.status)
        for i in infos
    ]
    print_table("wtransfer components", ("kind", "name", "provider", "target", "status"), rows)
    return 0
