"""Typed options: a component declares them once, as a dataclass; its base class parses them once.

A component names what it accepts from the user's free-form dict (``WeightTransferConfig.options``,
``kv_connector_extra_config``, a trainer's ``init_info``) in a dataclass of :func:`option` fields;
:func:`parse_options` builds it or raises :class:`~wtransfer.errors.InvalidOptionError` naming the key, a "did you
mean", the valid keys, or the expected type. ``wtransfer show KIND NAME`` prints :func:`describe_options`.

    @dataclass
    class StorageOptions:
        path: str = option(doc="directory that holds the blocks")
        io_threads: int = option(2, doc="threads that read and write block files")

A ``ValueError`` from ``__post_init__`` (range checks) is reported the same way. Understood types: ``int``,
``float`` (an int is accepted), ``bool``, ``str``, ``list``/``list[X]``, ``dict``/``dict[K, V]``, ``Any``,
``Literal[...]`` and ``X | None``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from wtransfer.errors import InvalidOptionError

T = TypeVar("T")

_REQUIRED = dataclasses.MISSING


def option(default: Any = _REQUIRED, *, doc: str | None = None, default_factory: Any = _REQUIRED) -> Any:
    """A dataclass field with a one-line ``doc``; no default means the option is required. Leave ``doc`` out only to
    redeclare a base class's option with another default (the base's doc is kept)."""
    metadata = {"inherits_doc": True} if doc is None else {"doc": doc}
    if default_factory is not _REQUIRED:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a component that takes none."""


def _fields(options_cls: type) -> dict[str, dataclasses.Field[Any]]:
    fields = {f.name: f for f in dataclasses.fields(options_cls) if f.init and not f.name.startswith("_")}
    for name, f in fields.items():
        if f.metadata.get("inherits_doc") and not _doc(options_cls, name):
            raise TypeError(  # a typo (bucket_byte) would add an option and leave the intended default as it was
                f"{options_cls.__qualname__}.{name} = option(...) has no doc and no base class documents an "
                f"option of that name (a misspelled name?); options a class adds need option(default, doc=...)"
            )
    return fields


def _doc(options_cls: type, name: str) -> str:
    """An option's doc: its own, or that of the nearest base class declaring it (a redeclared default)."""
    for cls in options_cls.__mro__:
        field = getattr(cls, "__dataclass_fields__", {}).get(name)
        if field is not None and "doc" in field.metadata:
            return str(field.metadata["doc"])
    return ""


def type_name(tp: Any) -> str:
    """How an option's type reads in errors and tables: ``int``, ``str or None``, ``one of 'lru', 'arc'``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any"
    if tp is type(None):
        return "None"
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        return " or ".join([type_name(a) for a in rest] + (["None"] if len(rest) < len(args) else []))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = typing.get_args(tp)
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join(type_name(a) for a in args)}]" if args else base
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    """``(ok, value)``: whether ``value`` has type ``tp`` (ints become floats where a float is asked)."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, coerced = _coerce(arg, value)
            if ok:
                return True, coerced
        return False, value
    if origin is typing.Literal:
        return value in typing.get_args(tp), value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(item, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            return False, value
        key_tp, value_tp = typing.get_args(tp) or (Any, Any)
        pairs = [(_coerce(key_tp, k), _coerce(value_tp, v)) for k, v in value.items()]
        return all(k[0] and v[0] for k, v in pairs), {k[1]: v[1] for k, v in pairs}
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def unknown_keys_message(unknown: list[str], valid: list[str]) -> str:
    """``'io_thread' (did you mean 'io_threads'?)`` for each unknown key, comma-separated."""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    return ", ".join(hints)


def parse_options(options_cls: type[T], raw: Mapping[str, Any] | None, *, owner: str, where: str = "options") -> T:
    """Check ``raw`` against ``options_cls`` and build it; :class:`InvalidOptionError` names what is wrong.
    ``owner`` names the component in messages ("storage connector"), ``where`` the user's dict
    ("kv_connector_extra_config")."""
    if isinstance(raw, options_cls):
        return raw
    raw = dict(raw or {})
    specs = _fields(options_cls)
    valid = sorted(specs)
    unknown = sorted((key for key in raw if key not in specs), key=str)
    if unknown:
        raise InvalidOptionError(
            f"{owner}: unknown option(s) {unknown_keys_message(unknown, valid)} in {where}; "
            f"valid options: {', '.join(valid) or '(none)'}"
        )
    missing = [
        name for name, f in specs.items()
        if name not in raw and f.default is _REQUIRED and f.default_factory is _REQUIRED
    ]
    if missing:
        details = "; ".join(f"{name!r}: {_doc(options_cls, name)}" for name in missing)
        raise InvalidOptionError(f"{owner} needs option(s) {', '.join(map(repr, missing))} in {where} ({details})")
    hints = typing.get_type_hints(options_cls)
    values = {}
    for key, value in raw.items():
        ok, coerced = _coerce(hints[key], value)
        if not ok:
            raise InvalidOptionError(
                f"{owner}: option {key!r} in {where} must be {type_name(hints[key])}, "
                f"got {value!r} ({type(value).__name__})"
            )
        values[key] = coerced
    try:
        return options_cls(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidOptionError):
            raise
        raise InvalidOptionError(f"{owner}: {exc} (in {where})") from None


def parse_declared(options_cls: type | None, raw: Mapping[str, Any] | None, *, owner: str, where: str) -> Any:
    """:func:`parse_options` for an ``options_cls`` that may be ``None`` (undeclared: the component gets an unchecked
    copy of its dict). Every kind's base class parses through here, so engines, connectors and specs share the rule."""
    if options_cls is None:
        return dict(raw or {})
    return parse_options(options_cls, raw, owner=owner, where=where)


def option_value(options: Any, name: str, default: Any = None) -> Any:
    """One option from parsed options or, for an undeclared component, its plain dict."""
    if isinstance(options, Mapping):
        return options.get(name, default)
    return getattr(options, name, default)


def describe_options(options_cls: type) -> list[dict[str, Any]]:
    """One JSON-safe row per option: ``name``, ``type``, ``default`` (``None`` if required), ``required``, ``doc``."""
    hints = typing.get_type_hints(options_cls)
    rows = []
    for name, f in _fields(options_cls).items():
        required = f.default is _REQUIRED and f.default_factory is _REQUIRED
        default = None if required else (f.default if f.default is not _REQUIRED else f.default_factory())
        rows.append({
            "name": name,
            "type": type_name(hints[name]),
            "default": default,
            "required": required,
            "doc": _doc(options_cls, name),
        })
    return rows


def options_dict(options: Any) -> dict[str, Any]:
    """A parsed options dataclass back as a plain dict (to forward to a child component)."""
    return {name: getattr(options, name) for name in _fields(type(options))}


__all__ = [
    "InvalidOptionError",
    "NoOptions",
    "describe_options",
    "option",
    "option_value",
    "options_dict",
    "parse_declared",
    "parse_options",
    "type_name",
    "unknown_keys_message",
]
