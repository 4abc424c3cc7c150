"""PEP 562 lazy exports: a public module names what it offers and where it lives.

Used by ``wtransfer/__init__.py`` and the toolkit modules (``wtransfer.engines``,
``wtransfer.engines.wire``, ``wtransfer.connectors``, ``wtransfer.specs``), so that importing
any of them costs a dict and a function: the module defining a name is imported the first
time the name is used.
It imports only ``sys`` (built in): not ``typing``, not ``importlib``, not even
``__future__`` (each costs a bare interpreter a fraction of a millisecond it never pays otherwise).
"""

import sys


def _import(module: str):
    return __import__(module, fromlist=["__name__"])  # the submodule itself, not its top package


def _from_import(frame) -> bool:
    """Whether ``frame`` is running ``from module import name`` (not ``getattr``/``hasattr``).

    ``f_lasti`` is the offset of the running instruction in the unspecialised ``co_code``
    (CPython 3.10-3.13); on 3.10 it may point at the ``EXTENDED_ARG`` prefixes of an
    ``IMPORT_FROM`` whose name index exceeds 255, which are skipped.
    """
    try:
        import opcode  # only on the error path of a moved name

        code, at = frame.f_code.co_code, frame.f_lasti
        while code[at] == opcode.EXTENDED_ARG:
            at += 2
        return code[at] == opcode.opmap["IMPORT_FROM"]
    except Exception:  # another interpreter's frames: fall back to a plain AttributeError
        return False


def lazy_exports(owner: str, exports: "dict[str, str]", moved: "dict[str, str] | None" = None):
    """The ``__getattr__`` and ``__dir__`` of module ``owner`` exporting ``exports`` (name -> module).

    ``moved`` (name -> the public module that now offers it) makes a name this module no
    longer exports fail with a message that says where it went, instead of being re-exported
    from its old home too. ``getattr`` and ``hasattr``
    get an ``AttributeError``, as for any missing name (so ``hasattr(module, name)`` is simply
    False); ``from module import name`` gets an ``ImportError`` carrying the message, because
    the import statement would replace an ``AttributeError`` with a message of its own.
    """
    namespace = sys.modules[owner].__dict__
    moved = moved or {}

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            if name in moved:
                message = (f"{owner}.{name} moved to {moved[name]}: import it from there "
                           f"(`from {moved[name]} import {name}`); see CHANGELOG.md")
                if _from_import(sys._getframe(1)):
                    raise ImportError(message, name=owner)
                raise AttributeError(message)
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        value = getattr(_import(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> "list[str]":
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
