"""Delta rounds (``create_trainer(..., delta=True)``) on a real transformers Llama trained by AdamW.

Every check compares weights: the workers' tensors, digest by digest, against the trainer's after
every round, never a label. The trainer trains in bf16 at the learning rates RL uses, so most
elements do not change from one round to the next and most tensors travel as compressed XORs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zstandard")

import wtransfer  # noqa: E402
from wtransfer.engines.trainer.delta_encoder import DeltaEncoder  # noqa: E402
from wtransfer.engines.rounds.delta_loader import DeltaLoader  # noqa: E402
from wtransfer.engines.rounds.manifest import (  # noqa: E402
    POSITION_BLOCK,
    POSITIONS,
    XOR_ZSTD,
    build_manifest,
    position_blocks,
    positions_header_bytes,
    tensor_bytes,
)
from wtransfer.engines.rounds.source import ModuleSource, TensorSource  # noqa: E402
from wtransfer.errors import ManifestMismatchError, TransferError  # noqa: E402
from wtransfer.local import LocalWorkerPool  # noqa: E402
from wtransfer.testing.models import digests, tiny_llama  # noqa: E402

FACTORY = "wtransfer.testing.models:tiny_llama"
TIMEOUT = 60.0
LEARNING_RATES = [1e-7, 1e-6, 1e-5, 1e-5]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _pool(backend: str, workers: int = 2) -> LocalWorkerPool:
    # seed 1: the workers start from other weights than the trainer's (seed 0)
    return LocalWorkerPool(workers, FACTORY, backend=backend, factory_kwargs={"seed": 1, "frozen_embedding": True},
                           timeout_s=TIMEOUT, torch_threads=1)


def _assert_workers_hold(pool: LocalWorkerPool, model: torch.nn.Module, when: str) -> None:
    expected = digests(model)
    for rank, got in enumerate(pool.digests()):
        wrong = sorted(name for name in expected if got.get(name) != expected[name])
        assert not wrong, f"{when}: worker {rank} differs from the trainer in {wrong[:5]}"


def _trainer(backend: str, pool: LocalWorkerPool, model: torch.nn.Module, **options: Any) -> Any:
    return wtransfer.create_trainer(backend, client=pool, source=model, delta=True,
                                    init_info={"world_size": pool.world_size, "timeout_s": TIMEOUT,
                                               "bucket_bytes": 64 * 1024}, **options)


@pytest.mark.parametrize(("backend", "commit"), [("shm", "atomic"), ("gloo", "atomic"), ("shm", "streaming")])
def test_delta_rounds_after_real_adamw_steps_are_bit_exact_and_small(backend: str, commit: str) -> None:
    model = tiny_llama(seed=0, frozen_embedding=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    with _pool(backend) as pool:
        trainer = _trainer(backend, pool, model, commit=commit)
        try:
            first = trainer.send_weights()
            assert first["delta"] == "full" and first["wire_bytes"] == first["bytes"]
            _assert_workers_hold(pool, model, "round 1 (full)")
            for step, lr in enumerate(LEARNING_RATES, start=2):
                _train(model, optimizer, lr, step)
                stats = trainer.send_weights()
                _assert_workers_hold(pool, model, f"round {step} (lr {lr:g})")
                print(f"round {step}, lr {lr:g}: {stats['changed_fraction']:.4%} of elements changed, wire "
                      f"{stats['wire_bytes']} of {stats['bytes']} bytes ({stats['wire_bytes'] / stats['bytes']:.4f}), "
                      f"{stats['sparse_tensors']} as XOR, {stats['dense_tensors']} dense, "
                      f"{stats['unchanged_tensors']} unchanged")
                assert stats["delta"] == "delta" and stats["version"] == step
                assert 0 < stats["changed_fraction"] < 0.2
                assert stats["sparse_tensors"] > 0
                assert stats["wire_bytes"] < 0.25 * stats["bytes"]
                assert stats["unchanged_tensors"] >= 1  # the frozen embedding: nothing after round 1
            idle = trainer.send_weights()  # nothing trained: nothing moves, and the workers still match
            assert idle["wire_bytes"] == 0 and idle["changed_fraction"] == 0
            _assert_workers_hold(pool, model, "a round with nothing changed")
        finally:
            trainer.shutdown()


def test_a_delta_against_a_base_the_workers_do_not_hold_becomes_a_full_round() -> None:
    """The trainer's base no longer matches what the workers hold: the encoder sees it (the base's
    bytes no longer hash to what it sent) and sends that tensor whole; a round against a base the
    workers never committed is refused before any byte moves and sent whole at once."""
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with _pool("shm") as pool:
        trainer = _trainer("shm", pool, model)
        try:
            trainer.send_weights()
            _train(model, optimizer, 1e-5, 2)
            name = "model.layers.0.mlp.up_proj.weight"
            trainer.delta.base[name].view(-1)[:8].add_(1)  # the trainer's idea of the workers' weights is wrong
            stats = trainer.send_weights()  # its XOR would rebuild something else: that tensor goes whole
            assert stats["delta"] == "delta" and stats["version"] == 2 and stats["dense_tensors"] >= 1
            _assert_workers_hold(pool, model, "the round after the trainer's base changed behind its back")
            _train(model, optimizer, 1e-5, 3)
            trainer.delta.base_id = "another:7"  # a round the workers never committed
            stats = trainer.send_weights()
            assert stats["delta"] == "full" and stats["version"] == 3
            _assert_workers_hold(pool, model, "the full round after a delta against another round")
            _train(model, optimizer, 1e-5, 4)
            stats = trainer.send_weights()
            assert stats["delta"] == "delta" and stats["version"] == 4  # back to deltas
            _assert_workers_hold(pool, model, "the next delta round")
        finally:
            trainer.shutdown()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_workers_restarted_between_rounds_get_the_next_round_whole_and_deltas_after(backend: str) -> None:
    """The workers restart (new processes, their models back at other weights) and the same trainer
    reconnects: its delta is refused by every restarted worker, which gets that round whole at once;
    the round after is a delta again. Catches: a trainer that sends a delta to workers without its
    base (they would rebuild garbage or fail), or one that cannot talk to restarted workers at all."""
    model = tiny_llama(seed=0, frozen_embedding=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    with _pool(backend) as pool:
        trainer = _trainer(backend, pool, model)
        trainer.send_weights()
        _train(model, optimizer, 1e-6, 2)
        assert trainer.send_weights()["delta"] == "delta"
        _assert_workers_hold(pool, model, "before the restart")
    try:
        with _pool(backend) as restarted:  # fresh processes: seed 1 weights, no committed round
            trainer.reconnect(client=restarted)
            _train(model, optimizer, 1e-6, 3)
            stats = trainer.send_weights()
            assert stats["delta"] == "full" and stats["version"] == 3, stats
            assert "holds no round of this trainer (new, restarted or torn)" in stats["delta_refused"]
            _assert_workers_hold(restarted, model, "the round after the restart")
            _train(model, optimizer, 1e-6, 4)
            stats = trainer.send_weights()
            assert stats["delta"] == "delta" and stats["version"] == 4 and stats["wire_bytes"] < 0.25 * stats["bytes"]
            _assert_workers_hold(restarted, model, "the delta after the restart")
    finally:
        trainer.shutdown()


def test_a_delta_that_rebuilds_wrong_values_fails_the_round_and_every_worker_keeps_its_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One XOR changed after the trainer hashed the new value: every worker rebuilds, sees the
    digest differ, and the atomic round leaves both models at the previous version."""
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with _pool("shm") as pool:
        trainer = _trainer("shm", pool, model)
        try:
            trainer.send_weights()
            _train(model, optimizer, 1e-5, 2)
            trainer.send_weights()
            before = pool.digests()
            _train(model, optimizer, 1e-5, 3)
            encode = DeltaEncoder.encode

            def corrupting(self: DeltaEncoder, *args: Any, **kwargs: Any) -> Any:
                encoded = encode(self, *args, **kwargs)
                sparse = [i for i, row in enumerate(encoded.plan.tensors) if row.encoding == XOR_ZSTD]
                import zstandard

                index = sparse[0]
                xor = bytearray(zstandard.ZstdDecompressor().decompress(
                    encoded.payloads[index].numpy().tobytes(), max_output_size=encoded.plan.tensors[index].target.nbytes))
                xor[5] ^= 0x01  # one bit of one element
                blob = zstandard.ZstdCompressor(level=1).compress(bytes(xor))
                encoded.payloads[index] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                entry = encoded.entries[index]
                encoded.entries[index] = type(entry)(entry.name, "uint8", (len(blob),))
                return encoded

            monkeypatch.setattr(DeltaEncoder, "encode", corrupting)
            with pytest.raises(TransferError, match="differs from the trainer's new value"):
                trainer.send_weights()
            assert pool.digests() == before, "a round that failed its digests changed a worker's weights"
        finally:
            trainer.shutdown()


def test_a_worker_without_the_base_refuses_a_delta_before_any_byte_moves() -> None:
    """What a new or restarted worker (it committed nothing from this trainer) does with a delta."""
    model = tiny_llama(seed=0)
    encoder = DeltaEncoder()
    full = encoder.encode(ModuleSource(model), 1)
    encoder.committed(full)
    with torch.no_grad():
        model.lm_head.weight.view(-1)[:64].mul_(1.5)
    delta = encoder.encode(ModuleSource(model), 2)
    manifest = build_manifest(delta.metadata(), 2, delta=delta.plan)
    worker_model = tiny_llama(seed=0)
    from wtransfer.engines.worker.loader import module_loader

    real = module_loader(worker_model)
    with pytest.raises(ManifestMismatchError, match="holds no round of this trainer"):
        DeltaLoader(real, real, manifest, holds=None).validate_manifest(manifest)
    with pytest.raises(ManifestMismatchError, match="cannot apply a delta round"):
        DeltaLoader(real, lambda batch: None, manifest, holds=full.plan.id).validate_manifest(manifest)

    class WholeRounds:  # as the vLLM bridge's loader: every round handed over whole
        whole_round = True
        destination = real.destination

        def __call__(self, batch):  # type: ignore[no-untyped-def]
            raise AssertionError("a refused round loaded nothing")

    with pytest.raises(ManifestMismatchError, match="needs every round whole"):
        DeltaLoader(real, WholeRounds(), manifest, holds=full.plan.id).validate_manifest(manifest)
    # the same worker holding that round applies it, bit-exactly
    loader = DeltaLoader(real, real, manifest, holds=full.plan.id)
    loader.validate_manifest(manifest)
    loader(list(delta))
    assert digests(worker_model) == digests(model)


def test_a_worker_whose_kept_tensor_changed_behind_wtransfers_back_refuses_the_delta() -> None:
    """Tensors a delta round leaves out are checked too: a worker whose frozen embedding was
    reloaded or edited since its last commit (it still 'holds' the round by name) refuses, so
    the trainer sends the round whole instead of leaving the stale tensor under the new version."""
    model = tiny_llama(seed=0, frozen_embedding=True)
    encoder = DeltaEncoder()
    full = encoder.encode(ModuleSource(model), 1)
    encoder.committed(full)
    worker_model = tiny_llama(seed=0, frozen_embedding=True)
    from wtransfer.engines.worker.loader import module_loader

    real = module_loader(worker_model)
    with torch.no_grad():
        model.lm_head.weight.view(-1)[:64].mul_(1.5)  # trained: travels as a XOR
        worker_model.model.embed_tokens.weight.view(-1)[3] += 1  # frozen, but edited on the worker
    delta = encoder.encode(ModuleSource(model), 2)
    assert "model.embed_tokens.weight" in {entry.name for entry in delta.plan.unchanged}
    manifest = build_manifest(delta.metadata(), 2, delta=delta.plan)
    with pytest.raises(ManifestMismatchError, match="'model.embed_tokens.weight' is not the version"):
        DeltaLoader(real, real, manifest, holds=full.plan.id).validate_manifest(manifest)
    assert digests(worker_model)["lm_head.weight"] != digests(model)["lm_head.weight"], "refused, yet written"


def test_the_whole_round_after_a_refusal_comes_from_the_base_without_walking_the_source_again() -> None:
    """A one-shot source (a generator of tensors made as they are read) is walked once per round:
    the full round a refusing worker gets is built from the trainer's base, bit for bit."""
    model = tiny_llama(seed=0)
    encoder = DeltaEncoder()
    encoder.committed(encoder.encode(ModuleSource(model), 1))
    with torch.no_grad():
        model.lm_head.weight.view(-1)[:64].mul_(1.5)
    walks = []

    class OneShot(ModuleSource):
        def __iter__(self):  # type: ignore[no-untyped-def]
            walks.append(1)
            return super().__iter__() if len(walks) == 1 else iter(())

    delta = encoder.encode(OneShot(model), 2)
    whole = encoder.whole(delta)
    assert len(walks) == 1 and whole.plan.base is None and not whole.plan.unchanged
    assert {name: digest_of(t) for name, t in whole} == {name: digest_of(t.detach()) for name, t in
                                                          model.state_dict().items() if name in dict(whole)}
    assert len(dict(whole)) == len(list(model.parameters()))


def test_a_slow_tensor_leaves_no_core_idle_and_the_round_keeps_the_walks_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the walk's first tensor is still being encoded, the next ones start on the other cores (a walk that
    waited for the oldest would start one per other core, then none); no more run at once than there are cores,
    and the round lists every tensor in the walk's order, its values exact."""
    import threading
    import time

    from wtransfer.engines.rounds.packing import pool_size
    from wtransfer.engines.trainer import delta_encoder

    width = pool_size()
    if width < 2:
        pytest.skip("one core: nothing runs beside the slow tensor")
    tensors = {f"t{i}": torch.arange(i, i + 64, dtype=torch.float32) for i in range(4 * width)}
    encoder = DeltaEncoder()
    encoder.committed(encoder.encode(TensorSource(tensors), 1))
    with torch.no_grad():
        for tensor in tensors.values():
            tensor[0] += 1
    real, lock, first_done = delta_encoder._encode_one, threading.Lock(), threading.Event()
    running, most, beside_the_first = [0], [0], []

    def encode_one(name: str, *args: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            if name != "t0" and not first_done.is_set():
                beside_the_first.append(name)
        try:
            if name == "t0":
                time.sleep(1.0)
            return real(name, *args)
        finally:
            with lock:
                running[0] -= 1
            if name == "t0":
                first_done.set()

    monkeypatch.setattr(delta_encoder, "_encode_one", encode_one)
    round_ = encoder.encode(TensorSource(tensors), 2)
    sent = {name: tensor.clone() for name, tensor in round_}
    encoder.committed(round_)
    assert len(beside_the_first) >= 2 * width, beside_the_first
    assert most[0] <= width
    assert [entry.name for entry in round_.entries] == list(tensors)
    assert all(torch.equal(encoder.base[name], tensor) for name, tensor in tensors.items())
    assert set(sent) == set(tensors)


def test_the_largest_tensors_are_encoded_first_and_the_round_keeps_the_sources_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's largest tensor often comes last (its output projection): encoded last, it would run alone while
    the other cores idle. The plain tensors of a source that holds them (a dict, a module) are taken largest first
    (ties in order); the round lists them in the source's order and the base takes their values. A source that
    makes its tensors as it yields them, or holds other kinds of tensors (a sharded one is gathered as it is
    yielded), is walked in its own order (taking them out of order would hold them all at once)."""
    tensors = {f"t{i}": torch.arange(i, i + 64 * (i % 3 + 1), dtype=torch.float32) for i in range(6)}  # 64, 128, 192
    taken: list[str] = []
    base_for = DeltaEncoder._base_for

    def recording(self: DeltaEncoder, name: str, new: torch.Tensor) -> Any:
        taken.append(name)  # on the walking thread, in the order encodings are submitted
        return base_for(self, name, new)

    monkeypatch.setattr(DeltaEncoder, "_base_for", recording)
    encoder = DeltaEncoder()
    encoder.committed(encoder.encode(TensorSource(tensors), 1))
    assert taken == ["t2", "t5", "t1", "t4", "t0", "t3"]
    with torch.no_grad():
        for tensor in tensors.values():
            tensor[1] += 1
    taken.clear()
    round_ = encoder.encode(TensorSource(tensors), 2)
    assert [row.target.name for row in round_.plan.tensors] == list(tensors)
    assert [entry.name for entry in round_.entries] == list(tensors)
    encoder.committed(round_)
    assert all(torch.equal(encoder.base[name], tensor) for name, tensor in tensors.items())

    class MadeAsItYields(TensorSource):
        def __iter__(self) -> Any:
            for name, tensor in self.tensors.items():
                yield name, tensor.clone()

    taken.clear()
    encoder.committed(encoder.encode(MadeAsItYields(tensors), 3))
    assert taken == list(tensors)

    class Marked(torch.Tensor):  # stands for a tensor subclass, such as a sharded DTensor
        pass

    taken.clear()
    marked = {name: tensor.as_subclass(Marked) if name == "t0" else tensor for name, tensor in tensors.items()}
    encoder.committed(encoder.encode(TensorSource(marked), 4))
    assert taken == list(tensors)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 64))  # weights 16, 256; biases 4, 64
    taken.clear()
    DeltaEncoder().encode(ModuleSource(model), 1).finish()
    assert taken == ["1.weight", "1.bias", "0.weight", "0.bias"]


def digest_of(tensor: torch.Tensor) -> str:
    from wtransfer.engines.rounds.delta import digest

    return digest(tensor)


def _compiled_or_numpy(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Delta rounds on the compiled helpers (``_kernels.c``), which must then be built, or on the numpy path (none
    to call); the names of the compiled helpers called, filled in as the test runs."""
    import wtransfer.engines.rounds.kernels as kernels

    calls: set[str] = set()
    if not compiled:
        monkeypatch.setattr(kernels, "_COMPILED", None)
        return calls
    kernel = kernels.compiled()
    assert kernel is not None, "wtransfer/engines/rounds/_kernels.c was not built (no C compiler at install?)"

    class Spy:
        def __getattr__(self, name: str) -> Any:
            function = getattr(kernel, name)

            def called(*args: Any) -> Any:
                calls.add(name)
                return function(*args)
            return called
    monkeypatch.setattr(kernels, "_COMPILED", Spy())
    return calls


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("chunk_bytes", [4096, 4098 * 2])
def test_tensors_spanning_many_chunks_round_trip_bit_exactly(chunk_bytes: int, compiled: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked paths (positions gathered chunk by chunk, XOR, compression, old-bytes digest,
    chunked decompression with a short tail) on tensors of many chunks: every round is bit-exact,
    a change of a few elements travels as positions, one of some per cent as a XOR, a change
    dense in a later chunk only goes whole."""
    import wtransfer.engines.rounds.delta as delta_module
    from wtransfer.engines.worker.loader import module_loader

    monkeypatch.setattr(delta_module, "CHUNK_BYTES", chunk_bytes)
    calls = _compiled_or_numpy(compiled, monkeypatch)
    model = tiny_llama(seed=0)
    worker_model = tiny_llama(seed=0)
    real = module_loader(worker_model)
    encoder = DeltaEncoder()
    holds = None
    expected = {"sparse": POSITIONS, "some": XOR_ZSTD, "late-dense": "dense"}
    for version, change in enumerate(["none", "sparse", "some", "late-dense", "sparse"], start=1):
        with torch.no_grad():
            weight = model.lm_head.weight.view(-1)  # 1024 x 128 bf16: 64 chunks of 4 KiB
            if change == "sparse":
                weight[:: 997].add_(1.0)  # 0.1 % of the elements
            elif change == "some":
                weight[3 :: 16].add_(1.0)  # 6 %: positions would take 12.5 % of the bytes, a XOR less
            elif change == "late-dense":
                weight[weight.numel() // 2 :].mul_(1.01)  # the first half unchanged: dense only later
        encoded = encoder.encode(ModuleSource(model), version)
        rows = {row.target.name: row.encoding for row in encoded.plan.tensors}
        if change in expected:
            assert rows["lm_head.weight"] == expected[change], change
        manifest = build_manifest(encoded.metadata(), version, delta=encoded.plan)
        loader = DeltaLoader(real, real, manifest, holds=holds)
        loader.validate_manifest(manifest)
        loader(list(encoded))
        encoder.committed(encoded)
        holds = encoded.plan.id
        assert digests(worker_model) == digests(model), f"round {version} ({change})"
    if compiled:  # (the numpy variant has no compiled helpers to call)
        assert calls == {"gather", "place"}, calls


@pytest.mark.parametrize("chunk_bytes", [1024 * 1024, 4096], ids=["chunks-of-blocks", "blocks-of-chunks"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_positions_across_many_blocks_round_trip_bit_exactly_at_two_bytes_a_position(
        chunk_bytes: int, in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A positions payload numbers elements in blocks of 65536 (a uint16 position each, a count
    per block). Tensors of several blocks and a part of one, changed at the first and the last
    element of blocks, in a block's last partial span, with a block left unchanged, walked in
    chunks larger than a block and smaller than one: bit-exact, and the payload is the block counts
    plus element size + 2 bytes a changed element. Catches: a position carried into the wrong
    block, a last partial block mis-sized, a span boundary dropping or repeating a change."""
    import wtransfer.engines.rounds.delta as delta_module

    monkeypatch.setattr(delta_module, "CHUNK_BYTES", chunk_bytes)
    numel = 3 * POSITION_BLOCK + 777
    g = torch.Generator().manual_seed(3)
    trainer = {"bf16": torch.randn(numel, generator=g).to(torch.bfloat16), "f32": torch.randn(numel, generator=g)}
    model = _Committed({name: t.clone() for name, t in trainer.items()})
    encoder = DeltaEncoder()
    encoder.committed(encoder.encode(TensorSource(trainer), 1))
    holds = encoder.base_id
    where = torch.tensor([0, POSITION_BLOCK - 1, POSITION_BLOCK, 3 * POSITION_BLOCK, numel - 2, numel - 1]
                         + list(range(100, 2 * POSITION_BLOCK, 331)))  # block 2 unchanged, block 3 (partial) at both ends
    with torch.no_grad():
        for tensor in trainer.values():
            tensor[where] += 1
    encoded = encoder.encode(TensorSource(trainer), 2)
    manifest = build_manifest(encoded.metadata(), 2, delta=encoded.plan)
    for row, entry in zip(encoded.plan.tensors, encoded.metadata()):
        assert row.encoding == POSITIONS, row
        changed = where.numel()
        assert entry.nbytes == positions_header_bytes(row.target) + changed * (trainer[row.target.name].element_size() + 2)
    loader = DeltaLoader(model if in_place else _Staged(model), model, manifest, holds=holds)
    loader.validate_manifest(manifest)
    loader(list(encoded))
    encoder.committed(encoded)
    assert {name: _raw(t) for name, t in model.tensors.items()} == {name: _raw(t) for name, t in trainer.items()}
    assert {name: _raw(t) for name, t in encoder.base.items()} == {name: _raw(t) for name, t in trainer.items()}


class _Committed:
    """A worker's committed tensors, as a loader shows them: ``destination()`` and a load call."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def destination(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in batch:
            if tensor.data_ptr() != self.tensors[name].data_ptr():
                self.tensors[name].copy_(tensor)


class _Staged(_Committed):
    """An atomic round's commit layer: rebuilt tensors land in a staging copy, never in the model."""

    def __init__(self, model: _Committed) -> None:
        super().__init__({name: torch.empty_like(t) for name, t in model.tensors.items()})
        self.model = model

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self.model(batch)


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor_bytes(tensor).numpy().tobytes()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("kept", [True, False], ids=["mapping", "one-shot"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_every_dtype_round_trips_bit_exactly_through_short_unaligned_chunks(
        in_place: bool, kept: bool, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """1-, 2-, 4-, 8- and 16-byte elements, an empty tensor and a non-contiguous trainer tensor, in
    short chunks (CHUNK_BYTES 4100: 4100 bytes for elements of up to 4 bytes, 4096 for 8 and 16, a
    size the scratch buffer must take for any dtype): every round bit-exact, rebuilt in place or
    into a separate staging copy, changed elements counted as elements (a complex128 whose two
    halves moved is one), sent as positions (about 1 % changed) and as XORs (11 %), and a
    positions payload or a XOR wrong only in its last element fails the round (staged: with the
    worker's model untouched) and is followed by a full round. From a mapping (its tensors
    kept: the work of tensors sent whole is left pending and done as the round is read) and from a
    one-shot iterator (every tensor encoded before the round). Changes are gathered and placed by
    the compiled one-pass code (``_kernels.c``) on both sides, or by the numpy path taken where that
    was not built; chunk edges fall inside 8-byte words."""
    import zstandard

    import wtransfer.engines.rounds.delta as delta_module

    calls = _compiled_or_numpy(compiled, monkeypatch)
    monkeypatch.setattr(delta_module, "CHUNK_BYTES", 4100)
    g = torch.Generator().manual_seed(0)
    trainer = {
        "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3000, generator=g),
        "f64": torch.randn(3000, generator=g, dtype=torch.float64),
        "c128": torch.randn(3000, generator=g, dtype=torch.complex128),
        "u8": torch.randint(0, 250, (9000,), generator=g, dtype=torch.uint8),
        "i32": torch.randint(-10**6, 10**6, (3000,), generator=g, dtype=torch.int32),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(60, 200, generator=g).t(),  # not contiguous on the trainer
    }
    model = _Committed({name: torch.zeros(t.shape, dtype=t.dtype) for name, t in trainer.items()})
    encoder, holds = DeltaEncoder(), None

    def send(version: int, corrupt: str | None = None) -> Any:
        nonlocal holds
        source = TensorSource(trainer) if kept else iter(list(trainer.items()))
        encoded = encoder.encode(source, version)  # type: ignore[arg-type]
        manifest = build_manifest(encoded.metadata(), version, delta=encoded.plan)
        loader = DeltaLoader(model if in_place else _Staged(model), model, manifest, holds=holds)
        loader.validate_manifest(manifest)
        batch = list(encoded)
        if corrupt is not None:
            at = [name for name, _ in batch].index(corrupt)
            row = next(row for row in encoded.plan.tensors if row.target.name == corrupt)
            if row.encoding == XOR_ZSTD:
                size = trainer[corrupt].numel() * trainer[corrupt].element_size()
                xor = bytearray(zstandard.ZstdDecompressor().decompress(_raw(batch[at][1]), max_output_size=size))
                xor[-3] ^= 0x10  # wrong in the tensor's last chunk only
                blob = zstandard.ZstdCompressor().compress(bytes(xor))
            else:
                assert row.encoding == POSITIONS
                blob = bytearray(_raw(batch[at][1]))
                target = row.target
                pairs = (len(blob) - positions_header_bytes(target)) // (trainer[corrupt].element_size() + 2)
                last_value = positions_header_bytes(target) + pairs * trainer[corrupt].element_size() - 1
                blob[last_value] ^= 0x10  # the last changed element's new value, one bit off
            batch[at] = (corrupt, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        loader(batch)
        encoder.committed(encoded)
        holds = encoded.plan.id
        return encoded

    def assert_worker_holds(when: str) -> None:
        wrong = [name for name, t in trainer.items() if _raw(model.tensors[name]) != _raw(t)]
        assert not wrong, f"{when}: the worker differs in {wrong}"

    send(1)
    assert_worker_holds("the full round")
    edges: dict[str, set[int]] = {}
    with torch.no_grad():
        for name, tensor in trainer.items():
            if name == "strided":
                tensor[::7, ::5] += 1
            elif name == "c128":
                tensor[::97] += 1 + 1j  # both halves: still one changed element each
            elif name != "empty":
                tensor[::97] += 1
            if name in ("bf16", "f32", "u8", "i32"):  # the first chunk's last element (in a part 8-byte word)
                # and the second chunk's first
                step = delta_module.CHUNK_BYTES // tensor.element_size()
                edges[name] = {step - 1, step}
                for at in edges[name]:
                    tensor[at] += 1
    expected = sum(len(set(range(0, t.numel(), 97)) | edges.get(n, set()))
                   for n, t in trainer.items() if n not in ("strided", "empty"))
    expected += len(range(0, 200, 7)) * len(range(0, 60, 5))
    encoded = send(2)
    assert encoded.stats.changed_elements == expected
    assert {row.target.name for row in encoded.plan.tensors if row.encoding == POSITIONS} >= {
        "bf16", "f32", "i32", "u8", "f64", "c128"}
    assert_worker_holds("a sparse round")
    with torch.no_grad():
        for name, tensor in trainer.items():
            if name not in ("strided", "empty"):
                tensor[1::9] += 1  # 11 %: positions would be too large, a compressed XOR is not
    encoded = send(3)
    assert {row.target.name for row in encoded.plan.tensors if row.encoding == XOR_ZSTD} >= {"f64", "c128", "u8"}
    assert_worker_holds("a round of XORs")
    with torch.no_grad():
        for name in ("f64", "c128"):
            trainer[name][-1] += 1  # in the last chunk only
    assert send(4).stats.changed_elements == 2
    assert_worker_holds("a round changing the last chunks")
    assert send(5).stats.changed_elements == 0
    assert_worker_holds("a round with nothing changed")

    for step, every in enumerate((50, 9)):  # a wrong positions payload, then a wrong XOR
        before = {name: _raw(t) for name, t in model.tensors.items()}
        with torch.no_grad():
            trainer["f64"][::every] += 1
        with pytest.raises(TransferError, match="'f64' rebuilt here differs"):
            send(6 + 2 * step, corrupt="f64")
        if not in_place:  # staged: the model never saw the round
            assert {name: _raw(t) for name, t in model.tensors.items()} == before
        assert send(7 + 2 * step).plan.base is None  # the base is ahead of the worker: a full round
        assert_worker_holds("the full round after a failed one")
    if compiled:  # (the numpy variant has no compiled helpers to call)
        assert calls == {"gather", "place"}, calls


def _every_element_moved(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.view(-1).view(torch.int16).add_(1)  # one unit in the last place: every tensor goes whole


def test_a_tensor_that_travels_whole_in_a_delta_round_is_received_in_place() -> None:
    """As in a round without deltas, a tensor sent whole and split over buckets is written straight
    into the commit's destination (the staging copy), not assembled in a fresh tensor first and
    copied again: on this host that extra copy into new memory made a delta round with every
    element changed cost twice a dense round's CPU on the worker."""
    from wtransfer.engines.rounds.packing import Unpacker, plan_buckets

    model = tiny_llama(seed=0)
    committed = _Committed({name: t.detach().clone() for name, t in model.named_parameters()})
    encoder = DeltaEncoder()
    encoder.committed(encoder.encode(ModuleSource(model), 1))
    holds = encoder.base_id
    _every_element_moved(model)
    encoded = encoder.encode(ModuleSource(model), 2)
    manifest = build_manifest(encoded.metadata(), 2, delta=encoded.plan)
    staged = _Staged(committed)
    loader = DeltaLoader(staged, committed, manifest, holds=holds)
    loader.validate_manifest(manifest)
    unpacker = Unpacker(manifest, loader)
    values = dict(encoded)
    split = set()
    for bucket in plan_buckets(manifest.entries, 4096):  # as the shm engine lays a round out
        data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for piece in bucket.pieces:
            source = tensor_bytes(values[manifest.entries[piece.index].name])
            data[piece.offset : piece.offset + piece.length] = source[piece.start : piece.start + piece.length]
            if not piece.whole:
                split.add(manifest.entries[piece.index].name)
        unpacker.unpack(bucket, data)
        assembled_apart = [part for part in unpacker._splits.values() if not part.in_place]
        assert not assembled_apart, "a tensor sent whole was assembled apart, to be copied again"
    unpacker.finish()
    assert split, "no tensor spans buckets: the test needs one"
    for name in split:
        assert _raw(staged.tensors[name]) == _raw(values[name]), f"{name!r} did not land in staging"


def test_a_round_abandoned_while_its_whole_tensors_are_pending_is_followed_by_an_exact_full_round() -> None:
    """The tensors of a round that go whole are finished (base updated, hashed) on the encoding
    threads while the engine sends the ones before them. A round whose engine stopped part-way is
    settled (nothing of it keeps writing the trainer's base); the next round is whole and leaves
    the worker, which still holds the first round, with exactly the trainer's weights."""
    from wtransfer.engines.worker.loader import module_loader

    model, worker = tiny_llama(seed=0), tiny_llama(seed=1)
    real = module_loader(worker)
    encoder = DeltaEncoder()

    def apply(encoded: Any, version: int, holds: str | None) -> None:
        manifest = build_manifest(encoded.metadata(), version, delta=encoded.plan)
        loader = DeltaLoader(real, real, manifest, holds=holds)
        loader.validate_manifest(manifest)
        loader(list(encoded))
        encoder.committed(encoded)

    apply(encoder.encode(ModuleSource(model), 1), 1, None)
    holds = encoder.base_id
    _every_element_moved(model)
    abandoned = encoder.encode(ModuleSource(model), 2)
    walk = iter(abandoned)
    next(walk), next(walk)  # the engine sent two tensors, then the link died
    walk.close()
    abandoned.settle()
    with torch.no_grad():
        model.lm_head.weight.view(-1)[::97].add_(1.0)
    third = encoder.encode(ModuleSource(model), 3)
    assert third.plan.base is None, "the base is ahead of every worker: the next round must be whole"
    apply(third, 3, holds)
    assert digests(worker) == digests(model)
    holds = encoder.base_id
    with torch.no_grad():
        model.lm_head.weight.view(-1)[::89].add_(1.0)
    fourth = encoder.encode(ModuleSource(model), 4)  # and deltas resume against it
    assert fourth.plan.base == holds and fourth.stats.sparse_tensors == 1
    apply(fourth, 4, holds)
    assert digests(worker) == digests(model)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_a_delta_round_sent_whole_records_what_it_sent_and_the_next_round_is_a_delta(
        compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta round the workers refuse is sent whole from the trainer's base (``whole()``), after its
    ``positions`` tensor was gathered and put into that base. What was sent must be the model, and the
    digests the trainer records those of its base: the next round is then a delta against the whole
    round, with nothing sent whole. Catches a base not brought up to the gathered values (the workers
    get the old tensor) and digests that disagree with the base (the next round finds its base "changed
    behind its back" and sends that tensor whole)."""
    calls = _compiled_or_numpy(compiled, monkeypatch)
    model = tiny_llama(seed=0)
    encoder = DeltaEncoder()
    encoder.committed(encoder.encode(ModuleSource(model), 1))
    with torch.no_grad():
        model.lm_head.weight.view(-1)[::97].add_(1.0)
    encoded = encoder.encode(ModuleSource(model), 2)
    assert [row.encoding for row in encoded.plan.tensors] == [POSITIONS], encoded.plan.tensors
    whole = encoder.whole(encoded)
    sent = {name: tensor.clone() for name, tensor in whole}
    encoder.committed(whole)
    wrong = [name for name, tensor in model.state_dict().items() if not torch.equal(sent[name], tensor)]
    assert not wrong, f"the round sent whole differs from the model in {wrong}"
    with torch.no_grad():
        model.lm_head.weight.view(-1)[::101].add_(1.0)
    after = encoder.encode(ModuleSource(model), 3)
    assert after.plan.base == whole.plan.id, "the round after the whole one is not a delta against it"
    assert (after.stats.sparse_tensors, after.stats.dense_tensors) == (1, 0), after.stats
    if compiled:  # (the numpy variant has no compiled helpers to call)
        assert calls == {"gather", "place"}, calls


def test_a_positions_payload_that_does_not_fit_its_tensor_is_refused() -> None:
    """A manifest whose positions payload is not its block counts and whole (value, position)
    pairs, or names no base digest, is refused as it is parsed. On the worker, for a tensor of
    several blocks and a partial last one: block counts that do not add up to the values, or a
    position past the tensor's end, fail the round before anything reaches the commit; counts
    moved from one block to the next (the sum right, the positions in range) rebuild another
    tensor, which the digest check refuses."""
    from wtransfer.engines.rounds.manifest import Manifest

    numel = 3 * POSITION_BLOCK + 777
    trainer = {"big": torch.randn(numel, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)}
    committed = _Committed({name: t.clone() for name, t in trainer.items()})
    encoder = DeltaEncoder()
    encoder.committed(encoder.encode(TensorSource(trainer), 1))
    holds = encoder.base_id
    with torch.no_grad():
        trainer["big"][::997] += 1  # in every block
        trainer["big"][-5:] += 1  # and in the partial last one
    encoded = encoder.encode(TensorSource(trainer), 2)
    manifest = build_manifest(encoded.metadata(), 2, delta=encoded.plan)
    assert [row.encoding for row in encoded.plan.tensors] == [POSITIONS]
    wire = manifest.to_dict()
    assert Manifest.from_dict(wire) == manifest
    torn = copy.deepcopy(wire)
    torn["tensors"][0][2] = [torn["tensors"][0][2][0] + 1]
    with pytest.raises(ValueError, match="and a whole number of"):
        Manifest.from_dict(torn)
    baseless = copy.deepcopy(wire)
    baseless["delta"]["tensors"][0][5] = None
    with pytest.raises(ValueError, match="with a base digest"):
        Manifest.from_dict(baseless)

    before = {name: _raw(t) for name, t in committed.tensors.items()}
    loader = DeltaLoader(_Staged(committed), committed, manifest, holds=holds)
    loader.validate_manifest(manifest)
    good = _raw(next(iter(encoded))[1])
    counts = [int.from_bytes(good[4 * i : 4 * i + 4], "little") for i in range(position_blocks(encoded.plan.tensors[0].target))]
    assert len(counts) == 4 and all(counts), counts

    def with_counts(new: list[int]) -> bytearray:
        out = bytearray(good)
        for i, count in enumerate(new):
            out[4 * i : 4 * i + 4] = count.to_bytes(4, "little")
        return out

    past_the_end = bytearray(good)
    past_the_end[-2:] = (POSITION_BLOCK - 1).to_bytes(2, "little")  # the last position, past the tensor's end
    cases = [(with_counts([counts[0], counts[1] + 1, *counts[2:]]), "positions payload does not fit its"),
             (past_the_end, "positions payload does not fit its"),
             (with_counts([counts[0] - 1, counts[1] + 1, *counts[2:]]), "'big' rebuilt here differs")]
    for wrong, error in cases:
        with pytest.raises(TransferError, match=error):
            loader([("big", torch.frombuffer(wrong, dtype=torch.uint8))])
        assert {name: _raw(t) for name, t in committed.tensors.items()} == before


def test_the_link_speed_sets_which_payloads_pay() -> None:
    """A round that moved enough bytes measures the link. On a fast one a tensor with 6 % of its
    elements changed travels as positions and one with 17 % whole (compressing would cost more
    than the wire saves); on a slow one a tensor with 6 % and one with 12 % as compressed XORs,
    the smallest on the wire. Every round bit-exact."""
    from wtransfer.engines.worker.loader import module_loader

    model, worker = tiny_llama(seed=0), tiny_llama(seed=1)
    real = module_loader(worker)
    encoder = DeltaEncoder()

    def send(version: int, every: int) -> str:
        holds = encoder.base_id
        with torch.no_grad():
            model.lm_head.weight.view(-1)[version % every :: every].add_(1.0)
        encoded = encoder.encode(ModuleSource(model), version)
        manifest = build_manifest(encoded.metadata(), version, delta=encoded.plan)
        loader = DeltaLoader(real, real, manifest, holds=holds)
        loader.validate_manifest(manifest)
        loader(list(encoded))
        encoder.committed(encoded)
        assert digests(worker) == digests(model), f"round {version}"
        return {row.target.name: row.encoding for row in encoded.plan.tensors}["lm_head.weight"]

    send(1, 16)  # full
    encoder.sent(10**9, 1.0)  # 1 GB/s
    encoder.sent(10**3, 10.0)  # too few bytes to say anything about the link
    assert encoder.link_bytes_per_s == 1e9
    assert send(2, 16) == POSITIONS
    assert send(3, 6) == "dense"
    encoder.sent(10**9, 100.0)  # a round that read slow (its time went to encoding): the link is no slower
    assert encoder.link_bytes_per_s == 1e9
    encoder.link_bytes_per_s = None
    encoder.sent(10**9, 100.0)  # 10 MB/s
    assert send(4, 16) == XOR_ZSTD
    assert send(5, 8) == XOR_ZSTD


class _ChecksTheManifestOnly(wtransfer.WeightTransferEngine):
    """A third-party engine that checks its loader's ``validate_manifest`` before its transport, as the seed API
    asks, but never the framework's ``validate_round()``; ``moved`` counts the tensors its transport carried."""

    init_info_cls = dict  # type: ignore[assignment]
    update_info_cls = wtransfer.engines.ManifestUpdateInfo
    values: dict[str, torch.Tensor] = {}
    moved = 0

    def init_transfer_engine(self, init_info: Any) -> None:
        pass

    def receive_weights(self, update_info: Any, load_weights: Any) -> None:
        load_weights.validate_manifest(update_info.parsed)
        for entry in update_info.parsed.entries:
            type(self).moved += 1
            load_weights([(entry.name, self.values[entry.name])])

    def shutdown(self) -> None:
        pass


def test_a_delta_round_at_a_used_label_is_refused_by_validate_manifest_before_the_transport() -> None:
    """The framework refuses a round whose label does not go up before the engine runs. An engine that asks only
    its loader's ``validate_manifest`` must hear it there, before its transport moves a byte (a collective engine
    that learns it at its first write leaves its peers waiting), and the worker keeps its delta round whole."""
    from wtransfer.engines.rounds.manifest import CommitPlan
    from wtransfer.engines.worker.loader import module_loader

    model, worker = tiny_llama(seed=0), tiny_llama(seed=1)
    load = module_loader(worker)
    engine = _ChecksTheManifestOnly(wtransfer.WeightTransferConfig(backend="hand"))
    encoder = DeltaEncoder()

    def send(version: int, label: int) -> None:
        encoded = encoder.encode(ModuleSource(model), version)
        manifest = build_manifest(encoded.metadata(), label, commit=CommitPlan("streaming", "k", 10.0),
                                  delta=encoded.plan)
        _ChecksTheManifestOnly.values = dict(encoded)
        try:
            engine.receive_weights(engine.parse_update_info({"manifest": manifest.to_dict()}), load)
            engine.finish_weight_update()
            encoder.committed(encoded)
        finally:
            encoded.settle()

    try:
        send(1, 1)
        with torch.no_grad():
            model.lm_head.weight.view(-1)[::89].add_(1.0)
        send(2, 2)
        assert encoder.base_id is not None and digests(worker) == digests(model)
        held = digests(worker)
        with torch.no_grad():
            model.lm_head.weight.view(-1)[::97].add_(1.0)
        moved = _ChecksTheManifestOnly.moved
        with pytest.raises(ManifestMismatchError, match="Labels only go up"):
            send(3, 2)
        assert _ChecksTheManifestOnly.moved == moved, "the transport ran for a round the framework had refused"
        assert digests(worker) == held and engine.weight_version == 2 and not engine.weights_torn
    finally:
        engine.shutdown()
