"""Importing ``module:attr`` targets, with errors that name what failed."""

from __future__ import annotations

import importlib


def import_target(target: str) -> object:
    """Import ``"package.module:Attr"`` (``Attr`` may be dotted) and return the attribute."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"Expected 'module:attribute', got {target!r}")
    obj: object = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj
