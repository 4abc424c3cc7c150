"""The worker-side weight-transfer engine contract (vLLM's ``WeightTransferEngine``, kept).

An engine lives inside one inference worker process. The trainer drives a round through the
user's control plane; the worker's handler calls, in order::

    engine.init_transfer_engine(engine.parse_init_info(init_dict))   # once
    engine.start_weight_update()                                       # every round
    engine.receive_weights(engine.parse_update_info(update_dict), load_weights)
    engine.finish_weight_update()
    ...
    engine.shutdown()                                                  # idempotent

The framework wraps every subclass's ``receive_weights``, ``finish_weight_update`` and ``shutdown``
to apply the trainer's commit mode (see :mod:`wtransfer.engines.rounds.commit`): ``atomic`` (default; a failed round leaves the
model bit-identical) or ``streaming`` (a failed round leaves it torn, and it says so).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from wtransfer import options as _options
from wtransfer.config import ParallelConfig, WeightTransferConfig
from wtransfer.engines.rounds.commit import round_state, wrap_round_methods
from wtransfer.engines.rounds.packing import LoadWeights  # noqa: F401  (where engines import it from)

if TYPE_CHECKING:
    from wtransfer.engines.rounds.cast import ServedDtypes

TInitInfo = TypeVar("TInitInfo", bound="WeightTransferInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo", bound="WeightTransferUpdateInfo")


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024 - a marker base, as in the seed
    """Base class for an engine's one-time initialisation info (a JSON-safe dict on the wire)."""


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024
    """Base class for an engine's per-round update info (a JSON-safe dict on the wire)."""

    _: KW_ONLY
    is_checkpoint_format: bool = True
    """True if the weights still need the model's own processing (checkpoint format); False: kernel format."""


@dataclass
class WeightTransferInitRequest:
    """API-level init request: the engine-agnostic dict an HTTP/RPC layer forwards."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """API-level update request: the engine-agnostic dict an HTTP/RPC layer forwards."""

    update_info: dict[str, Any] = field(default_factory=dict)


def parse_info(owner: str, info_cls: type, data: Any, what: str) -> Any:
    """Build ``info_cls`` from a dict, naming the engine and every bad field on failure."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} for {owner} must be a dict, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(info_cls) if f.init and f.name != "_"}
    unknown = sorted(set(data) - set(fields))
    missing = sorted(
        name
        for name, f in fields.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    problems = [f"unknown field {name!r}" for name in unknown]
    problems += [f"missing required field {name!r}" for name in missing]
    if problems:
        accepted = ", ".join(sorted(fields)) or "(none)"
        raise ValueError(
            f"Invalid {what} for {owner}: {'; '.join(problems)}. Accepted fields: {accepted}"
        )
    try:
        return info_cls(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Invalid {what} for {owner}: {exc}") from exc


def engine_label(cls: type) -> str:
    """How messages name an engine class: "shm engine (SharedMemoryWeightTransferEngine)"."""
    backend = getattr(getattr(cls, "trainer_cls", None), "backend", None)
    if isinstance(backend, str) and backend != "?":
        return f"{backend} engine ({cls.__name__})"
    return f"engine {cls.__name__}"


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """Worker side of a weight-transfer backend.

    Subclasses set ``init_info_cls`` and ``update_info_cls`` (dataclasses) and implement
    ``init_transfer_engine``, ``receive_weights`` and ``shutdown``.
    """

    init_info_cls: type[TInitInfo]
    update_info_cls: type[TUpdateInfo]
    trainer_cls: ClassVar[type | None] = None
    """The trainer side (a ``TrainerWeightTransferEngine`` subclass) ``create_trainer`` uses for this
    backend; ``None`` for worker-only engines."""
    options_cls: ClassVar[type | None] = None
    """The dataclass (fields made with :func:`wtransfer.options.option`) declaring what this engine accepts
    in ``WeightTransferConfig.options``. ``None``: undeclared, the dict is not checked and ``self.options``
    is that dict."""

    def __init__(
        self, config: WeightTransferConfig, parallel_config: ParallelConfig | None = None
    ) -> None:
        self.config = config
        self.parallel_config = parallel_config if parallel_config is not None else ParallelConfig()
        self.options: Any = self.parse_options(config.options)
        """The parsed ``options_cls`` instance (or ``config.options`` as given, if undeclared)."""
        self.served_dtypes: ServedDtypes | None = None
        """What this worker's model loads (``wtransfer.served_dtypes(model)``): set it before
        ``init_transfer_engine`` so floating tensors travel in the dtype the model takes."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        wrap_round_methods(cls)  # every engine gets commit modes and honest state, unasked

    @classmethod
    def parse_options(cls, raw: Any) -> Any:
        """Check ``WeightTransferConfig.options`` against ``options_cls`` at creation, so a typo fails
        here (naming the valid keys) instead of being ignored."""
        return _options.parse_declared(
            cls.options_cls, raw, owner=engine_label(cls), where="WeightTransferConfig.options"
        )

    @property
    def weight_version(self) -> int | None:
        """The trainer's version of the round the model holds; ``None`` while the model is torn.

        The trainer's ``stats["version"]`` for that round (0: the start-up weights), also across restarts
        and reconnects. Unchanged by a round that failed before commit; ``None`` after a streamed round
        or a commit failed part-way, until a complete round lands.
        """
        return round_state(self).weight_version

    @property
    def weights_torn(self) -> bool:
        """True while the model holds parts of two versions (see ``weight_version``)."""
        return round_state(self).torn

    @property
    def weights_identity(self) -> str | None:
        """A name for exactly the weights the model holds, the same on every worker that holds them: it changes
        whenever any tensor does, and two states never share one (``"startup"``: the start-up weights; None while
        torn, or after a round sent without a wtransfer trainer's manifest). vLLM's prefix-cache salt derives from it."""
        return round_state(self).holdings()["identity"]

    @property
    def round_seconds(self) -> dict[str, float]:
        """Where this worker's last round spent its time, in seconds: ``receive`` (this engine's receive),
        ``stage`` (until the round was whole in the node's copy), ``load`` (into the model, at commit) and
        ``finish`` (this engine's own finish); a phase not reached is missing."""
        return round_state(self).phases.to_dict()

    def held_weights(self) -> dict[str, Any]:
        """What this worker holds, JSON-safe (``version``, ``identity``, ``spent``: the highest version it began to
        commit). A transport sends it to the trainer when joining, so a new trainer numbers its rounds past every label in
        use and knows what its partial rounds apply on top of."""
        return round_state(self).holdings()

    def parse_init_info(self, init_dict: dict[str, Any]) -> TInitInfo:
        """Typed init info from the control plane's dict; ``ValueError`` names each bad field."""
        return parse_info(type(self).__name__, self.init_info_cls, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> TUpdateInfo:
        """Typed update info from the control plane's dict; ``ValueError`` names each bad field."""
        return parse_info(type(self).__name__, self.update_info_cls, update_dict, "update_info")

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Join the trainer's transport (rendezvous); called once before the first round."""

    def start_weight_update(self) -> None:
        """A round begins. Engines may prepare buffers here; the default does nothing."""

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo, load_weights: LoadWeights) -> None:
        """Receive one round's weights, calling ``load_weights`` incrementally.

        ``load_weights`` is the framework's: it writes into the node's staging copy (atomic) or the model
        (streaming); ``destination(name)``, where offered, lets transports receive in place. A transport
        with an accept/reject step asks :meth:`validate_round` before any byte moves, so a refusal stops
        every worker cleanly. Raise if the round is not whole.
        """

    def validate_round(self) -> None:
        """Raise :class:`~wtransfer.errors.ManifestMismatchError` if this worker's model cannot take the round
        being received (the framework checked it before ``receive_weights`` ran)."""
        round_state(self).validate_round()

    def finish_weight_update(self) -> None:
        """A round ended on every worker; the framework already committed it. Override for end-of-round work."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release every resource. Must be idempotent."""


wrap_round_methods(WeightTransferEngine)  # its own finish_weight_update too, for engines that keep it
