"""``wtransfer show KIND NAME``: load one component and describe the options a user passes it (its declared
``options_cls``; for an engine also its trainer's ``init_info``), never the wire dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

from wtransfer.cli._output import KIND_CHOICES, print_json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("show", help="load one component and show its docs and the options it takes")
    parser.add_argument("kind", choices=KIND_CHOICES)
    parser.add_argument("name", help="bare name (shm) or qualified (distribution:name)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    parser.set_defaults(func=run)


OPTIONS_WHERE = {"engines": "WeightTransferConfig.options", "connectors": "kv_connector_extra_config",
                 "specs": "kv_connector_extra_config"}  # fmt: skip
"""Where the user writes a kind's options: the heading of its table."""


def option_rows(cls: Any) -> list[dict[str, Any]] | None:
    """The options ``cls`` declares (its ``options_cls``), or ``None`` if it declares none."""
    from wtransfer.options import describe_options

    options_cls = getattr(cls, "options_cls", None)
    if not (isinstance(options_cls, type) and dataclasses.is_dataclass(options_cls)):
        return None
    return describe_options(options_cls)


def init_option_rows(cls: Any) -> list[dict[str, Any]] | None:
    """An engine's trainer ``init_info`` options, with the trainer class's own defaults."""
    trainer_cls = getattr(cls, "trainer_cls", None)
    describe = getattr(trainer_cls, "describe_init_options", None)
    return describe() if callable(describe) else None


def collect(kind: str, name: str) -> dict[str, Any]:
    """What ``show`` prints, as a JSON-safe dict: the user-facing options, never wire fields."""
    from wtransfer._registry.registry import registry_for

    registry = registry_for(kind)
    ref = registry.resolve(name)
    cls: Any = ref.load()
    data: dict[str, Any] = {
        "name": ref.name,
        "kind": registry.kind.name,
        "distribution": ref.distribution,
        "version": ref.version,
        "provider": ref.provider(),
        "target": ref.target,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "source": inspect.getsourcefile(cls),
        "doc": inspect.getdoc(cls) or "",
        "options_where": OPTIONS_WHERE.get(registry.kind.name, "options"),
        "options": option_rows(cls),
    }
    if registry.kind.name == "engines":
        trainer_cls = getattr(cls, "trainer_cls", None)
        data["trainer"] = None if trainer_cls is None else f"{trainer_cls.__module__}.{trainer_cls.__qualname__}"
        data["init_options"] = init_option_rows(cls)
    return data


def _table(rows: list[dict[str, Any]] | None) -> list[str]:
    """Plain aligned columns (name, type, default, doc): readable, greppable, never wrapped."""
    if rows is None:
        return ["    (no options declared)"]
    if not rows:
        return ["    (none: this component takes no options)"]
    cells = [(r["name"], r["type"], "(required)" if r["required"] else repr(r["default"]), r["doc"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return ["    " + "  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in cells]


def describe(kind: str, name: str) -> str:
    from wtransfer._registry.kinds import resolve_kind

    data = collect(kind, name)
    lines = [
        f"{resolve_kind(data['kind']).singular} {data['name']}",
        f"  class:    {data['class']}",
        f"  provider: {data['provider']}",
        f"  target:   {data['target']}",
        f"  source:   {data['source'] or '(unknown)'}",
        "",
        f"  options ({data['options_where']}):",
        *_table(data["options"]),
    ]
    if data["kind"] == "engines":
        trainer = data["trainer"]
        lines += ["", f"  trainer init_info ({trainer.rsplit('.', 1)[-1]}):" if trainer else "  trainer: (none)"]
        if trainer:
            lines += _table(data["init_options"])
    if data["doc"]:
        lines += ["", data["doc"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from wtransfer.errors import WTransferError

    try:
        if args.json:
            print_json(collect(args.kind, args.name))
        else:
            print(describe(args.kind, args.name))
    except WTransferError as exc:
        print(f"error: {exc}")
        return 1
    return 0
