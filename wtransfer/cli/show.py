"""``wtransfer show KIND NAME``: load one component and describe it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

from wtransfer.cli._output import KIND_CHOICES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("show", help="load one component and show its docs and config fields")
    parser.add_argument("kind", choices=KIND_CHOICES)
    parser.add_argument("name", help="bare name (shm) or qualified (distribution:name)")
    parser.set_defaults(func=run)


def _dataclass_fields(cls: type) -> list[str]:
    lines = []
    for f in dataclasses.fields(cls):
        if f.name == "_":
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        lines.append(f"    {f.name}: {type_name} = {default}")
    return lines


def describe(kind: str, name: str) -> str:
    from wtransfer._registry.registry import registry_for

    registry = registry_for(kind)
    ref = registry.resolve(name)
    cls: Any = ref.load()
    lines = [
        f"{registry.kind.singular} {ref.name}",
        f"  class:    {cls.__module__}.{cls.__qualname__}",
        f"  provider: {ref.provider()}",
        f"  target:   {ref.target}",
        f"  source:   {inspect.getsourcefile(cls) or '(unknown)'}",
    ]
    for attr in ("init_info_cls", "update_info_cls", "config_cls"):
        info_cls = getattr(cls, attr, None)
        if isinstance(info_cls, type) and dataclasses.is_dataclass(info_cls):
            lines.append(f"  {attr} = {info_cls.__qualname__}:")
            lines.extend(_dataclass_fields(info_cls) or ["    (no fields)"])
    doc = inspect.getdoc(cls)
    if doc:
        lines.append("")
        lines.append(doc)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from wtransfer.errors import WTransferError

    try:
        print(describe(args.kind, args.name))
    except WTransferError as exc:
        print(f"error: {exc}")
        return 1
    return 0
