"""Typed options: engines' ``WeightTransferConfig.options``, trainers' ``init_info``, ``wtransfer show``.

Each component declares its options once (a dataclass of ``option`` fields); these tests go
through the real entry points (the factory, ``create_trainer``, the CLI as a subprocess) so
that a component that forgets to declare, or to parse, its options fails here.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import wtransfer
from wtransfer import WeightTransferEngineFactory
from wtransfer.engines import SharedMemoryTrainer
from wtransfer.engines.gloo import GlooTrainer
from wtransfer.errors import InvalidOptionError
from wtransfer.options import NoOptions, describe_options, option, options_dict, parse_options

ROOT = Path(__file__).resolve().parents[1]


class UntouchedClient:
    """A client whose workers must never be asked anything: options are checked first."""

    def init_weight_transfer_engine(self, info: dict) -> None:
        raise AssertionError("a worker was asked to init although the trainer's init_info is invalid")

    def start_weight_update(self) -> None: ...

    def update_weights(self, info: dict) -> None: ...

    def finish_weight_update(self) -> None: ...


# -- worker engine options -------------------------------------------------------------------


def test_a_typo_in_shm_engine_options_is_refused_with_a_suggestion() -> None:
    """Catches: an engine that accepts any key (the typo used to be ignored, so no limit applied)."""
    config = wtransfer.WeightTransferConfig(backend="shm", options={"max_buffer_byte": 1})
    with pytest.raises(InvalidOptionError) as info:
        WeightTransferEngineFactory.create_engine(config)
    message = str(info.value)
    assert "'max_buffer_byte' (did you mean 'max_buffer_bytes'?)" in message
    assert "WeightTransferConfig.options" in message and "valid options: max_buffer_bytes" in message
    assert "shm engine" in message


def test_engine_options_are_parsed_once_into_the_declared_dataclass() -> None:
    """Catches: readers that still use the raw dict (a wrong type would pass) or no type check at all."""
    engine = WeightTransferEngineFactory.create_engine(
        wtransfer.WeightTransferConfig(backend="gloo", options={"max_buffer_bytes": 1 << 20, "interface": "lo"}))
    assert engine.options.max_buffer_bytes == 1 << 20 and engine.options.interface == "lo"
    with pytest.raises(InvalidOptionError, match=r"'max_buffer_bytes'.*must be int or None, got '1MB' \(str\)"):
        WeightTransferEngineFactory.create_engine(
            wtransfer.WeightTransferConfig(backend="gloo", options={"max_buffer_bytes": "1MB"}))
    with pytest.raises(InvalidOptionError, match="'local_address' or 'interface', not both"):
        WeightTransferEngineFactory.create_engine(wtransfer.WeightTransferConfig(
            backend="gloo", options={"local_address": "10.0.0.1", "interface": "eth0"}))


def test_buffer_budget_reads_the_parsed_limit() -> None:
    """Catches: check_buffer_budget ignoring the parsed options (a declared limit never enforced)."""
    from wtransfer.engines import check_buffer_budget

    engine = WeightTransferEngineFactory.create_engine(
        wtransfer.WeightTransferConfig(backend="shm", options={"max_buffer_bytes": 8192}))
    check_buffer_budget(engine, 4096, 2)
    with pytest.raises(ValueError, match="max_buffer_bytes=8192"):
        check_buffer_budget(engine, 4096, 3)


def test_an_engine_that_declares_no_options_keeps_reading_its_own_keys() -> None:
    """Catches: a base class that checks undeclared engines (third-party engines written before
    options were declared would start failing on their own keys)."""
    from wtransfer.engines import WeightTransferEngine, check_buffer_budget

    class Legacy(WeightTransferEngine):  # type: ignore[type-arg]
        init_info_cls = update_info_cls = NoOptions  # never parsed here

        def init_transfer_engine(self, init_info: Any) -> None: ...

        def receive_weights(self, update_info: Any, load_weights: Any) -> None: ...

        def shutdown(self) -> None: ...

    engine = Legacy(wtransfer.WeightTransferConfig(backend="legacy", options={"colour": "red", "max_buffer_bytes": 10}))
    assert engine.options == {"colour": "red", "max_buffer_bytes": 10}
    with pytest.raises(ValueError, match="max_buffer_bytes=10"):
        check_buffer_budget(engine, 4096, 1)


# -- trainer init_info -------------------------------------------------------------------------


def test_a_wrong_type_in_init_info_names_the_expected_type() -> None:
    """Catches: a trainer that lets '3' through (it would fail later, or mid-round, far from the cause)."""
    with pytest.raises(InvalidOptionError) as info:
        wtransfer.create_trainer("shm", client=UntouchedClient(), source={"a": torch.zeros(2)},
                                 init_info={"world_size": 2, "num_buffers": "3"})  # fmt: skip
    assert str(info.value) == (
        "the shm trainer: option 'num_buffers' in init_info must be int, got '3' (str)"
    )


def test_an_unknown_init_info_key_gets_a_suggestion_and_the_valid_keys() -> None:
    """Catches: unknown keys reported without the close match, or gloo's own keys missing from the declaration."""
    with pytest.raises(InvalidOptionError) as info:
        wtransfer.create_trainer("gloo", client=UntouchedClient(), source={"a": torch.zeros(2)},
                                 init_info={"world_size": 2, "bucket_byte": 4096})  # fmt: skip
    message = str(info.value)
    assert "'bucket_byte' (did you mean 'bucket_bytes'?)" in message
    for key in ("master_address", "master_port", "channels", "direct_min_bytes", "listen_address", "interface"):
        assert key in message.split("valid options:")[1], key


@pytest.mark.parametrize(
    ("init_info", "fragment"),
    [
        ({"world_size": 1}, "'world_size' must be >= 2, got 1"),
        ({"world_size": 2, "timeout_s": 0}, "'timeout_s' must be a positive number"),
        ({"world_size": 2, "bucket_bytes": 4097}, "multiple of 64"),
        ({"world_size": 2, "master_port": 70000}, "'master_port' must be 0"),
        ({"world_size": 2, "direct_min_bytes": 0}, "'direct_min_bytes' must be >= 1"),
        ({"world_size": True}, "'world_size' in init_info must be int, got True"),
    ],
)
def test_init_info_ranges_are_checked_before_any_worker(init_info: dict, fragment: str) -> None:
    """Catches: range checks lost when the hand-written parser was replaced by the dataclass."""
    with pytest.raises(InvalidOptionError, match=fragment):
        wtransfer.create_trainer("gloo", client=UntouchedClient(), source={"a": torch.zeros(2)}, init_info=init_info)


def test_a_backend_sets_its_defaults_by_redeclaring_fields() -> None:
    """Catches: defaults taken from anywhere but the options class (the table ``wtransfer show``
    prints and what the trainer uses disagreeing), a redeclared field losing its doc, or a
    subclass losing its base's defaults (shm's 4 MiB buckets)."""
    from dataclasses import dataclass

    from wtransfer.engines import SharedMemoryInitOptions
    from wtransfer.options import option

    @dataclass(frozen=True)
    class ThreeBuffers(SharedMemoryInitOptions):
        num_buffers: int = option(3)

    class Tuned(SharedMemoryTrainer):
        init_options_cls = ThreeBuffers

    options = Tuned(client=UntouchedClient(), source={}, init_info={"world_size": 2}).init_options
    assert (options.bucket_bytes, options.num_buffers, options.timeout_s) == (4 << 20, 3, 300.0)
    rows = {r["name"]: r for r in Tuned.describe_init_options()}
    assert rows["num_buffers"]["default"] == 3
    assert rows["num_buffers"]["doc"] == "buffers in flight: packing one overlaps moving the others"
    shm = {r["name"]: r["default"] for r in SharedMemoryTrainer.describe_init_options()}
    gloo = {r["name"]: r["default"] for r in GlooTrainer.describe_init_options()}
    assert (shm["bucket_bytes"], shm["num_buffers"]) == (4 << 20, 4)
    assert (gloo["bucket_bytes"], gloo["num_buffers"], gloo["channels"]) == (16 << 20, 8, 2)
    made = SharedMemoryTrainer(client=UntouchedClient(), source={}, init_info={"world_size": 2})
    assert (made.bucket_bytes, made.num_buffers) == (shm["bucket_bytes"], shm["num_buffers"])


def test_every_engine_option_is_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: an engine option or trainer init_info key (NCCL's included) shown without a doc,
    e.g. a redeclared default whose doc was not found in any base."""
    from wtransfer.engines.gloo import GlooWeightTransferEngine
    from wtransfer.engines.shm import SharedMemoryWeightTransferEngine

    monkeypatch.syspath_prepend(str(ROOT / "plugins" / "wtransfer-nccl"))
    from wtransfer_nccl.engine import NCCLTrainer, NCCLWeightTransferEngine

    for trainer in (SharedMemoryTrainer, GlooTrainer, NCCLTrainer):
        rows = trainer.describe_init_options()
        assert rows and all(row["doc"] for row in rows), (trainer.__name__, rows)
    for engine in (SharedMemoryWeightTransferEngine, GlooWeightTransferEngine, NCCLWeightTransferEngine):
        rows = describe_options(engine.options_cls)
        assert rows and all(row["doc"] for row in rows), (engine.__name__, rows)


def test_a_misspelled_redeclared_option_is_an_error() -> None:
    """Catches: ``bucket_byte = option(4 * MIB)`` (no doc, redeclaring nothing) quietly adding an
    undocumented option while the intended default stays as it was."""
    from dataclasses import dataclass

    from wtransfer.engines import SharedMemoryInitOptions
    from wtransfer.options import option

    @dataclass(frozen=True)
    class Typo(SharedMemoryInitOptions):
        bucket_byte: int = option(1 << 20)

    with pytest.raises(TypeError, match="Typo.bucket_byte = option.*has no doc and no base class documents"):
        describe_options(Typo)
    with pytest.raises(TypeError, match="misspelled"):
        parse_options(Typo, {"world_size": 2}, owner="t")


def test_a_trainer_whose_options_drop_its_bases_keys_is_refused() -> None:
    """Catches: a subclass naming options that do not extend its base's (gloo's address keys, or
    shm's ring size, would vanish without a word); and the torch.distributed base's own defaults
    lost by a subclass that names the base options (the 0.1 NCCL pattern kept 16 MiB x 8)."""
    from dataclasses import dataclass

    from wtransfer.engines import TorchDistributedInitOptions, TorchDistributedTrainer, TrainerInitOptions
    from wtransfer.options import option

    @dataclass(frozen=True)
    class Plain(TrainerInitOptions):
        num_buffers: int = option(3)

    with pytest.raises(TypeError, match="does not extend SharedMemoryInitOptions"):
        type("Tuned", (SharedMemoryTrainer,), {"init_options_cls": Plain})
    with pytest.raises(TypeError, match="does not extend GlooInitOptions"):
        type("MyGloo", (GlooTrainer,), {"init_options_cls": TorchDistributedInitOptions})
    mixin = type("PlainOptions", (), {"init_options_cls": Plain})  # set by a mixin ahead of the trainer
    with pytest.raises(TypeError, match="does not extend SharedMemoryInitOptions"):
        type("Mixed", (mixin, SharedMemoryTrainer), {})

    class Late(SharedMemoryTrainer):
        pass

    Late.init_options_cls = Plain  # set after the class was defined: caught at creation
    with pytest.raises(TypeError, match="Late.init_options_cls = .*Plain does not extend SharedMemoryInitOptions"):
        Late(client=UntouchedClient(), source={}, init_info={"world_size": 2})

    class Collective(TorchDistributedTrainer):
        init_options_cls = TorchDistributedInitOptions

    defaults = {r["name"]: r["default"] for r in Collective.describe_init_options()}
    assert (defaults["bucket_bytes"], defaults["num_buffers"], defaults["channels"]) == (16 << 20, 8, 2)


def test_nccl_declares_its_own_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: NCCL inheriting gloo's local_address/interface (which it would ignore) or gloo's channels."""
    monkeypatch.syspath_prepend(str(ROOT / "plugins" / "wtransfer-nccl"))
    from wtransfer_nccl.engine import NCCLTrainer, NCCLWeightTransferEngine

    init = {r["name"]: r["default"] for r in NCCLTrainer.describe_init_options()}
    assert init["channels"] == 1 and init["num_buffers"] == 4 and init["bucket_bytes"] == 32 << 20
    assert "local_address" not in init and "interface" not in init
    assert [r["name"] for r in describe_options(NCCLWeightTransferEngine.options_cls)] == ["max_buffer_bytes", "device"]
    with pytest.raises(InvalidOptionError, match="'interface'"):
        parse_options(NCCLTrainer.init_options_cls, {"world_size": 2, "interface": "eth0"}, owner="nccl")


# -- parse_options itself ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    path: str = option(doc="where")
    threads: int = option(2, doc="how many")
    ratio: float = option(0.5, doc="how much")
    verbose: bool = option(False, doc="say more")
    limit: int | None = option(None, doc="at most")
    policy: Literal["lru", "arc"] = option("lru", doc="which")
    tiers: list[int] = option(doc="sizes", default_factory=list)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"path": "/x", "thread": 1}, r"unknown option\(s\) 'thread' \(did you mean 'threads'\?\) in cfg; valid options: "
                                      r"limit, path, policy, ratio, threads, tiers, verbose"),
        ({}, r"needs option\(s\) 'path' in cfg \('path': where\)"),
        ({"path": "/x", "threads": True}, r"'threads' in cfg must be int, got True \(bool\)"),
        ({"path": "/x", "verbose": 1}, r"'verbose' in cfg must be bool, got 1 \(int\)"),
        ({"path": "/x", "ratio": "0.5"}, r"'ratio' in cfg must be float, got '0.5'"),
        ({"path": "/x", "limit": "3"}, r"'limit' in cfg must be int or None"),
        ({"path": "/x", "policy": "fifo"}, r"'policy' in cfg must be one of 'lru', 'arc', got 'fifo'"),
        ({"path": "/x", "tiers": [1, "2"]}, r"'tiers' in cfg must be list\[int\]"),
        ({"path": "/x", "tiers": 3}, r"'tiers' in cfg must be list\[int\]"),
    ],
)
def test_parse_options_errors(raw: dict, fragment: str) -> None:
    """Catches: each class of mistake (unknown, missing, bool-as-int and int-as-bool, Optional,
    Literal, list items) slipping through or being reported without the expected type."""
    with pytest.raises(InvalidOptionError, match=fragment):
        parse_options(Sample, raw, owner="sample", where="cfg")


def test_parse_options_accepts_good_values() -> None:
    """Catches: over-strict checks (an int for a float, None for Optional, a tuple for a list)."""
    parsed = parse_options(Sample, {"path": "/x", "ratio": 1, "limit": None, "policy": "arc", "tiers": (1, 2)},
                           owner="sample")  # fmt: skip
    assert parsed.ratio == 1.0 and isinstance(parsed.ratio, float)
    assert (parsed.limit, parsed.policy, parsed.tiers, parsed.threads) == (None, "arc", [1, 2], 2)
    assert options_dict(parsed)["tiers"] == [1, 2]
    assert parse_options(Sample, {"path": "/x", "limit": 4}, owner="sample").limit == 4
    assert parse_options(NoOptions, None, owner="none") == NoOptions()
    with pytest.raises(InvalidOptionError, match="valid options: \\(none\\)"):
        parse_options(NoOptions, {"x": 1}, owner="none")


# -- wtransfer show ------------------------------------------------------------------------------


def show(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "wtransfer", "show", *args],
                            capture_output=True, text=True, check=True, cwd=ROOT)  # fmt: skip
    return result.stdout


def test_show_engine_lists_user_options_not_wire_fields() -> None:
    """Catches: ``show`` printing the init-info wire dataclass (address, token, parsed) instead of options."""
    text = show("engine", "shm")
    assert "max_buffer_bytes" in text
    assert "world_size" in text and "(required)" in text
    assert "bucket_bytes" in text and "4194304" in text  # shm's own default, not the base class's
    for wire in ("address", "token", "parsed", "protocol_version", "rank_offset", "is_checkpoint_format"):
        assert wire not in text, wire


def test_show_engine_json() -> None:
    """Catches: --json missing, or the trainer's init_info table left out of it."""
    data = json.loads(show("engine", "shm", "--json"))
    assert (data["name"], data["kind"], data["distribution"]) == ("shm", "engines", "wtransfer")
    assert data["target"] == "wtransfer.engines.shm:SharedMemoryWeightTransferEngine" and data["doc"]
    assert [r["name"] for r in data["options"]] == ["max_buffer_bytes"]
    init = {r["name"]: r for r in data["init_options"]}
    assert set(init) == {"world_size", "timeout_s", "bucket_bytes", "num_buffers", "share_source"}
    assert init["world_size"]["required"] and init["num_buffers"]["default"] == 4
    assert "token" not in json.dumps(data)

    gloo = json.loads(show("engine", "gloo", "--json"))
    gloo_init = {r["name"]: r for r in gloo["init_options"]}
    assert {"master_address", "master_port", "listen_address", "direct_min_bytes", "channels",
            "local_address", "interface"} <= set(gloo_init)  # fmt: skip
    assert gloo_init["channels"] == {"name": "channels", "type": "int", "default": 2, "required": False,
                                     "doc": gloo_init["channels"]["doc"]}  # fmt: skip
    assert [r["name"] for r in gloo["options"]] == ["max_buffer_bytes", "local_address", "interface"]
