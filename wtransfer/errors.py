"""The public exception hierarchy.

Every error wtransfer raises derives from :class:`WTransferError`, and each one also
derives from the builtin a vLLM user would already catch (``ValueError`` for bad
names, ``ImportError`` for broken plugins, ``TypeError`` for wrong classes), so
code written against the seed factories keeps working.
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

    Raised by a streamed round that failed after its first write, or by an atomic commit that
    failed part-way; the worker's ``weight_version`` is ``None`` and ``weights_torn`` is True.
    Send a complete round (a new trainer if this one broke) before serving from that model.
    """


class ManifestMismatchError(WTransferError, ValueError):
    """An update manifest does not match the receiving model; nothing was written."""


__all__ = [
    "AmbiguousComponentError",
    "ComponentLoadError",
    "DisabledComponentError",
    "DuplicateComponentError",
    "InvalidComponentError",
    "ManifestMismatchError",
    "TransferError",
    "TransferTimeoutError",
    "UnknownComponentError",
    "WTransferError",
    "WeightsTornError",
]


class InvalidOptionError(WTransferError, ValueError):
    """A component's options are wrong: an unknown key, a missing one, or a value of the wrong type."""
