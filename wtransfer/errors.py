"""The public exception hierarchy.

Every error derives from :class:`WTransferError` and also from the builtin a vLLM user would already catch
(``ValueError`` for bad names, ``ImportError`` for broken plugins, ``TypeError`` for wrong classes).
"""

from __future__ import annotations


class WTransferError(Exception):
    """Base class of every error raised by wtransfer."""


class UnknownComponentError(WTransferError, ValueError):
    """No component of that kind is known by that name (with suggestions and install hints)."""


class AmbiguousComponentError(WTransferError, ValueError):
    """A bare name is provided by several distributions; use a qualified name."""


class DuplicateComponentError(WTransferError, ValueError):
    """A runtime registration used a name that is already taken."""


class DisabledComponentError(WTransferError, ValueError):
    """The component was disabled through ``WTRANSFER_DISABLE_PLUGINS``."""


class ComponentLoadError(WTransferError, ImportError):
    """A plugin failed to import or raised while loading; the cause is chained."""


class InvalidComponentError(WTransferError, TypeError):
    """A loaded object is not a subclass of its kind's base class."""


class TransferError(WTransferError, RuntimeError):
    """A weight or KV transfer failed (dead peer, protocol violation, bad data)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A peer did not answer within the configured timeout."""


class WeightsTornError(TransferError):
    """A round failed after part of it reached the model: it holds two versions until a whole round lands.

    Raised by a streamed round failing after its first write, or an atomic commit failing part-way; the worker's
    ``weight_version`` is ``None`` and ``weights_torn`` True. Send a complete round (from a new trainer if this one
    broke) before serving from that model."""


class ManifestMismatchError(WTransferError, ValueError):
    """An update manifest does not match the receiving model; nothing was written."""

    @classmethod
    def listing(cls, headline: str, problems: list[tuple[str, str | None]], todo: list[str]) -> ManifestMismatchError:
        """One error for every reason a round cannot load, one line per cause. ``problems`` are
        ``(cause, tensor name or None)`` pairs; a cause's tensors are counted and the first few named, so a
        model-wide mistake reads as one line. ``todo`` says what to do, once each, last."""
        causes: dict[str, list[str]] = {}
        for cause, name in problems:
            causes.setdefault(cause, [])
            if name is not None:
                causes[cause].append(repr(name))
        lines = []
        for cause, names in causes.items():
            if not names:
                lines.append(f"- {cause}")
                continue
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            lines.append(f"- {cause} ({len(names)} tensor{'s' if len(names) > 1 else ''}): {shown}")
        advice = "".join(f"\nWhat to do: {line}" for line in dict.fromkeys(todo))
        return cls(f"{headline}; nothing was written.\n" + "\n".join(lines) + advice)


__all__ = [
    "AmbiguousComponentError",
    "ComponentLoadError",
    "DisabledComponentError",
    "DuplicateComponentError",
    "InvalidComponentError",
    "InvalidOptionError",
    "ManifestMismatchError",
    "TransferError",
    "TransferTimeoutError",
    "UnknownComponentError",
    "WTransferError",
    "WeightsTornError",
    "error_from_text",
    "error_to_text",
]


class InvalidOptionError(WTransferError, ValueError):
    """A component's options are wrong: an unknown key, a missing one, or a value of the wrong type."""


def error_to_text(error: BaseException, worker: object) -> str:
    """``error`` as text that survives a strings-only process boundary (vLLM's RPC replies, an HTTP error body),
    for :func:`error_from_text` to raise again as its class. ``worker``: a rank ("worker 3") or who else raised it.
    It reads as a sentence too: "[wtransfer ManifestMismatchError from worker 0] ... [/wtransfer]"."""
    exported = _exported()
    cls = next((c for c in type(error).__mro__ if exported.get(c.__name__) is c), None)
    name = cls.__name__ if cls is not None else type(error).__name__
    source = f"worker {worker}" if isinstance(worker, int) else str(worker)
    return f"[wtransfer {name} from {source}] {error} [/wtransfer]"


def error_from_text(text: str) -> WTransferError | None:
    """The wtransfer errors :func:`error_to_text` embedded in ``text``, as one error, or None if there are none.

    Workers that failed alike are named together ("workers 0, 1: ..."). The class is :class:`WeightsTornError` if
    any says the weights are torn (what the user must act on), else :class:`ManifestMismatchError` if any refused the
    round, else theirs if they agree, else :class:`TransferError`; a foreign error keeps its class name in the text."""
    import re

    exported = _exported()
    found = re.findall(r"\[wtransfer (\w+) from ([^\]]+)\] (.*?) \[/wtransfer\]", text, re.S)
    if not found:
        return None
    classes = {exported.get(name, TransferError) for name, _, _ in found}
    for cls in (WeightsTornError, ManifestMismatchError):
        if cls in classes:
            break
    else:
        cls = classes.pop() if len(classes) == 1 else TransferError
    by_message: dict[str, list[str]] = {}
    for name, source, message in found:
        by_message.setdefault(message if name in exported else f"{name}: {message}", []).append(source)
    parts = []
    for message, sources in by_message.items():
        ranks = [s.removeprefix("worker ") for s in sources if s.startswith("worker ")]
        others = [s for s in sources if not s.startswith("worker ")]
        named = ([f"worker{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"] if ranks else []) + others
        parts.append(f"{' and '.join(named)}: {message}")
    return cls("\n".join(parts))


def _exported() -> dict[str, type[WTransferError]]:
    return {name: obj for name, obj in globals().items()
            if isinstance(obj, type) and issubclass(obj, WTransferError) and obj.__module__ == __name__}
