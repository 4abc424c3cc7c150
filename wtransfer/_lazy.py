"""PEP 562 lazy exports: a public module names what it offers and where it lives.

Used by ``wtransfer/__init__.py`` and the three toolkit modules (``wtransfer.engines``,
``wtransfer.connectors``, ``wtransfer.specs``), so that importing any of them costs a dict
and a function: the module defining a name is imported the first time the name is used.
It imports only ``sys`` (built in): not ``typing``, not ``importlib``, not even
``__future__`` (each costs a bare interpreter a fraction of a millisecond it never pays otherwise).
"""

import sys


def _import(module: str):
    return __import__(module, fromlist=["__name__"])  # the submodule itself, not its top package


def lazy_exports(owner: str, exports: "dict[str, str]", moved: "dict[str, str] | None" = None):
    """The ``__getattr__`` and ``__dir__`` of module ``owner`` exporting ``exports`` (name -> module).

    ``moved`` (name -> the public module that now offers it) turns an import of a name this
    module no longer exports into an error that says where it went: nothing is re-exported,
    so each name keeps one home. It is an ``ImportError``, not an ``AttributeError``, because
    ``from module import name`` replaces an ``AttributeError`` with a message of its own.
    """
    namespace = sys.modules[owner].__dict__
    moved = moved or {}

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            if name in moved:
                raise ImportError(
                    f"{owner}.{name} moved to {moved[name]}: import it from there "
                    f"(`from {moved[name]} import {name}`); see CHANGELOG.md", name=owner)
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        value = getattr(_import(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> "list[str]":
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
