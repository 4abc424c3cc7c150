"""PEP 562 lazy exports: a public module names what it offers and where it lives.

Used by ``wtransfer/__init__.py`` and the toolkit modules, so importing one costs a dict and a function; a name's
module is imported on its first use. Imports only ``sys``: not ``typing``, ``importlib`` or even ``__future__``.
"""

import sys


def _import(module: str):
    return __import__(module, fromlist=["__name__"])  # the submodule itself, not its top package


def lazy_exports(owner: str, by_module: "dict[str, tuple[str, ...]]"):
    """``__all__``, ``__getattr__`` and ``__dir__`` of module ``owner``, exporting ``by_module`` (module -> the
    names it defines)."""
    namespace = sys.modules[owner].__dict__
    exports = {name: module for module, names in by_module.items() for name in names}

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        value = getattr(_import(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> "list[str]":
        return sorted(set(namespace) | set(exports))

    return sorted(exports), __getattr__, __dir__
