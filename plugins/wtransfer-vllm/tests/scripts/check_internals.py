"""Check every vLLM internal the bridge relies on (``wtransfer_vllm.vllm_internals.INTERNALS``).

usage: check_internals.py OUT_JSON

Runs in the vLLM environment; writes ``[[Class.attribute, null or what is wrong], ...]`` in
the order of ``INTERNALS``. Nothing is
wrapped or registered here: it checks vLLM as it ships.
"""

import ast
import importlib
import inspect
import json
import sys
import textwrap

from wtransfer_vllm.vllm_internals import INTERNALS


def resolve(path):
    module_path, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


def set_on_self(owner, attribute):
    """Whether a vLLM class in ``owner``'s MRO assigns ``self.<attribute>`` in its source."""
    for klass in owner.__mro__:
        if not klass.__module__.startswith("vllm"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(item, ast.Attribute) and item.attr == attribute
                            and isinstance(item.value, ast.Name) and item.value.id == "self"):
                        return True
    return False


def problem(item):
    try:
        owner = importlib.import_module(item.path) if item.kind == "function" else resolve(item.path)
    except (ImportError, AttributeError) as exc:
        return f"{item.path} cannot be imported: {type(exc).__name__}: {exc}"
    if item.kind == "instance":
        if hasattr(owner, item.attribute) or set_on_self(owner, item.attribute):
            return None
        return f"no vLLM class of {owner.__name__} (or its bases) sets self.{item.attribute} any more"
    try:
        static = inspect.getattr_static(owner, item.attribute)
    except AttributeError:
        return f"{owner.__name__} has no attribute {item.attribute!r} any more"
    if item.kind == "dict":
        return None if isinstance(static, dict) else f"is a {type(static).__name__}, not a dict"
    if item.kind == "classmethod":
        if not isinstance(static, classmethod):
            return f"is a {type(static).__name__}, not a classmethod"
        function = static.__func__
    elif item.kind in ("method", "function"):
        if not inspect.isfunction(static):
            return f"is a {type(static).__name__}, not a plain {item.kind}"
        function = static
    else:
        return f"unknown kind {item.kind!r} in INTERNALS"
    names = list(inspect.signature(function).parameters)[item.kind != "function":]  # after self / cls
    if names[: len(item.params)] != list(item.params):
        return f"takes ({', '.join(names)}); the bridge passes ({', '.join(item.params)})"
    return None


if __name__ == "__main__":
    report = [[item.name, problem(item)] for item in INTERNALS]
    with open(sys.argv[1], "w") as out:
        json.dump(report, out, indent=1)
