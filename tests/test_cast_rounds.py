"""fp32 master weights reach bf16 workers as bf16: the trainer casts while it packs.

The trainer's model is a real transformers Llama in fp32 trained by AdamW (TRL's default
dtype); the workers' is the same Llama in bf16. Every check compares the workers' tensors with
the trainer's cast by ``tensor.to(torch.bfloat16)``, bit for bit, after every round.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import wtransfer  # noqa: E402
from wtransfer.errors import ManifestMismatchError  # noqa: E402
from wtransfer.local import LocalWorkerPool  # noqa: E402
from wtransfer.testing.models import digests, tiny_llama  # noqa: E402

TIMEOUT = 60.0
BUCKET = 64 * 1024  # the embedding (256 KiB in bf16) is split over buckets: its pieces are cast too


def _bf16_workers(backend: str) -> LocalWorkerPool:
    return LocalWorkerPool(2, "wtransfer.testing.models:tiny_llama", backend=backend,
                           factory_kwargs={"seed": 1, "dtype": "bfloat16"}, timeout_s=TIMEOUT, torch_threads=1)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _assert_workers_hold_bf16_of(pool: LocalWorkerPool, model: torch.nn.Module, when: str) -> None:
    expected = digests(copy.deepcopy(model).to(torch.bfloat16))
    for rank, got in enumerate(pool.digests()):
        wrong = sorted(name for name in expected if got.get(name) != expected[name])
        assert not wrong, f"{when}: worker {rank} differs from the trainer's weights cast to bf16 in {wrong[:5]}"


@pytest.mark.parametrize(("backend", "options"), [
    ("shm", {}), ("shm", {"commit": "streaming"}), ("gloo", {"checksums": True}), ("shm", {"delta": True}),
])
def test_fp32_masters_reach_bf16_workers_as_bf16_at_half_the_bytes(backend: str, options: dict[str, Any]) -> None:
    model = tiny_llama(seed=0, dtype="float32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = dict(model.named_parameters())
    fp32_bytes = sum(p.numel() * 4 for p in params.values())
    with _bf16_workers(backend) as pool:
        trainer = wtransfer.create_trainer(backend, client=pool, source=model, **options,
                                           init_info={"world_size": 3, "timeout_s": TIMEOUT, "bucket_bytes": BUCKET})
        try:
            for step in range(3):
                stats = trainer.send_weights()
                _assert_workers_hold_bf16_of(pool, model, f"round {step + 1}")
                assert stats["cast_tensors"] == len(params)
                assert stats["bytes"] == fp32_bytes // 2  # the wire carries bf16
                if options.get("delta") and step:
                    assert stats["wire_bytes"] < stats["bytes"]  # deltas are taken in the dtype served
                _train(model, optimizer, step)
            assert [s["weight_version"] for s in pool.stats()] == [3, 3]
        finally:
            trainer.shutdown()


def test_the_dtype_option_overrides_what_the_workers_load_and_is_validated_by_them() -> None:
    """``dtype="float16"`` sends fp16, which the bf16 workers refuse (nothing written; the trainer
    stays usable: its next round goes as far); ``dtype=torch.bfloat16`` then lands."""
    model = tiny_llama(seed=0, dtype="float32")
    with _bf16_workers("shm") as pool:
        before = pool.digests()
        info = {"world_size": 3, "timeout_s": TIMEOUT, "bucket_bytes": BUCKET}
        with wtransfer.create_trainer("shm", client=pool, source=model, init_info=info, dtype="float16") as trainer:
            for _ in range(2):
                with pytest.raises(Exception, match="dtype float16 != model bfloat16 \\(\\d+ tensors?\\)"):
                    trainer.send_weights()
        assert pool.digests() == before
        with wtransfer.create_trainer("shm", client=pool, source=model, init_info=info,
                                      dtype=torch.bfloat16) as trainer:
            trainer.send_weights()
        _assert_workers_hold_bf16_of(pool, model, "after dtype=torch.bfloat16")
    with pytest.raises(ValueError, match="dtype='int8' must be one of"):
        wtransfer.create_trainer("shm", client=pool, source=model, init_info=info, dtype="int8")


def test_workers_that_load_different_dtypes_fail_the_rendezvous_naming_both() -> None:
    from wtransfer.engines.rounds.cast import ServedDtypes, agreed

    same = ServedDtypes("bfloat16").to_dict()
    assert agreed({1: same, 2: same}) == ServedDtypes("bfloat16")
    assert agreed({1: None, 2: None}) is None
    with pytest.raises(wtransfer.WTransferError, match="workers 1 and 2 load different dtypes"):
        agreed({1: same, 2: ServedDtypes("float16").to_dict()})
    with pytest.raises(ValueError, match="served dtype 'int8'"):
        agreed({1: {"default": "int8", "names": {}}})


def test_integer_tensors_and_tensors_already_in_the_served_dtype_travel_as_they_are() -> None:
    from wtransfer.engines.rounds.cast import CastPlan, ServedDtypes
    from wtransfer.engines.rounds.manifest import TensorEntry

    entries = [TensorEntry("w", "float32", (4,)), TensorEntry("ids", "int64", (4,)),
               TensorEntry("norm", "float32", (4,)), TensorEntry("b", "bfloat16", (4,)),
               TensorEntry("scale", "float8_e4m3fn", (4,))]
    served = ServedDtypes("bfloat16", {"norm": "float32"})
    assert [e.dtype for e in CastPlan(served).entries(entries)] == [
        "bfloat16", "int64", "float32", "bfloat16", "float8_e4m3fn"]
    assert [e.dtype for e in CastPlan(None).entries(entries)] == [e.dtype for e in entries]


def llama_with_fp32_norms(layers: int) -> torch.nn.Module:
    """A bf16 Llama whose norms stay fp32, as serving stacks often keep them: its served dtypes name every norm."""
    model = tiny_llama(seed=1, hidden=64, layers=layers, vocab=256, dtype="bfloat16")
    for name, module in model.named_modules():
        if name.endswith("norm"):
            module.float()
    return model


def test_a_worker_naming_more_dtypes_than_a_stranger_may_send_joins_and_gets_each() -> None:
    """What a worker loads can be longer than the 4 KiB a peer may send before the trainer knows it (here one
    name per fp32 norm): it is said once the worker joined. fp32 masters then reach it as bf16, norms as fp32."""
    import json

    layers = 64
    served = wtransfer.served_dtypes(llama_with_fp32_norms(layers)).to_dict()
    assert len(json.dumps(served)) > 4096 and len(served["names"]) == 2 * layers + 1
    model = tiny_llama(seed=0, hidden=64, layers=layers, vocab=256, dtype="float32")
    expected = copy.deepcopy(model).to(torch.bfloat16)
    for name, module in expected.named_modules():
        if name.endswith("norm"):
            module.float()
    with LocalWorkerPool(1, llama_with_fp32_norms, backend="shm", factory_kwargs={"layers": layers},
                         timeout_s=TIMEOUT, torch_threads=1) as pool:
        with wtransfer.create_trainer("shm", client=pool, source=model,
                                      init_info={"world_size": 2, "timeout_s": TIMEOUT}) as trainer:
            stats = trainer.send_weights()
        assert pool.digests() == [digests(expected)]
        assert 0 < stats["cast_tensors"] < len(list(model.parameters()))  # the norms travel as they are
