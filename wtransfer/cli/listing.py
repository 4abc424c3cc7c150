"""``wtransfer list [KIND | plugins] [--json]``: what is installed.

Components come from metadata only (none is imported). Hook plugins are listed as the hook manager found them (it
imports them to register their hooks), so a broken one shows as ``broken`` with its error.
"""

from __future__ import annotations

import argparse
from typing import Any

from wtransfer.cli._output import KIND_CHOICES, print_json, print_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "list", help="list engines, connectors, specs and policies (from metadata: imports none) and hook plugins"
    )
    parser.add_argument("kind", nargs="?", choices=KIND_CHOICES + HOOK_PLUGIN_CHOICES,
                        help="only this kind ('plugins': only the hook plugins)")
    parser.add_argument("--json", action="store_true",
                        help=f"print a JSON list: one object per component (kind, name, distribution, version, "
                             f"target, status), then one per hook plugin (kind {HOOK_PLUGIN_KIND!r}, the same "
                             f"keys and 'problem')")
    parser.set_defaults(func=run)


HOOK_PLUGIN_KIND = "hook plugin"
"""The ``kind`` of hook-plugin rows in ``list --json`` and ``check --json``: no component kind has a space in it."""
HOOK_PLUGIN_CHOICES = ("plugins", "plugin")
DISABLED = "disabled by WTRANSFER_DISABLE_PLUGINS"


def hook_plugin_rows() -> list[dict[str, Any]]:
    """One row per module of the ``wtransfer.plugins`` group: status loaded / broken / disabled, and a broken one's
    error in ``problem``."""
    from wtransfer._registry.manager import hook_plugins

    return [
        {
            "kind": HOOK_PLUGIN_KIND,
            "name": plugin.record.name,
            "distribution": plugin.record.distribution,
            "version": plugin.record.version,
            "target": plugin.record.value,
            "status": plugin.status,
            "problem": plugin.error,
        }
        for plugin in hook_plugins()
    ]


def run(args: argparse.Namespace) -> int:
    from wtransfer._registry.names import qualify
    from wtransfer._registry.registry import list_components

    only_hooks = args.kind in HOOK_PLUGIN_CHOICES
    # every kind is discovered even for the hook plugins alone: calling a plugin's contributor may show it broken
    discovered = list_components(None if only_hooks else args.kind)
    infos = [] if only_hooks else discovered
    hooks = hook_plugin_rows() if args.kind is None or only_hooks else []
    if args.json:
        print_json([info.to_dict() for info in infos] + hooks)
        return 0
    if not only_hooks:
        rows = [
            (i.kind, i.name, qualify(i.distribution, i.name),
             f"{i.distribution} {i.version}" if i.distribution else "(runtime)", i.target, i.status)
            for i in infos
        ]
        print_table("wtransfer components", ("kind", "name", "qualified name", "provider", "target", "status"),
                    rows, whole=("name", "qualified name", "provider"))
    if args.kind is None or only_hooks:
        if hooks:
            print_table(
                "wtransfer hook plugins",
                ("name", "provider", "module", "status", "problem"),
                [(h["name"], f"{h['distribution']} {h['version']}", h["target"], h["status"],
                  h["problem"] or (DISABLED if h["status"] == "disabled" else ""))
                 for h in hooks],
                whole=("name", "provider", "module"),
            )
        else:
            print("No hook plugins installed (entry-point group 'wtransfer.plugins').")
    return 0
