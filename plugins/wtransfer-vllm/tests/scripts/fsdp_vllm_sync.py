"""A vLLM instance synced by an FSDP2-sharded trainer through vLLM's own trainer factory.

usage: fsdp_vllm_sync.py BACKEND MODEL_DIR OUT_JSON ROUNDS MODES

MODES: ``writes``, ``gathers`` or both (``writes,gathers``: one vLLM start, the modes in turn,
each a new trainer on new FSDP2 ranks' models that start from the checkpoint again).

Two trainer ranks (FSDP2 over a gloo default group, CPU). Rank 0 also holds the offline
``LLM``. Both call ``WeightTransferTrainerFactory.trainer_init`` with
``trainer_init_info(backend, rank=R, sharded=True)`` and vLLM's ``ModuleSource``, then
``send_weights()`` each round. ``writes``: the bridge hands the module to
wtransfer, and every rank sends its own shards. ``gathers``: vLLM's source behind a wrapper
of the user's, which wtransfer must read as it yields, so rank 0 gathers every parameter
(``full_tensor()``) and sends: the bridge's fallback for sources it cannot see into. The rounds take the same
deterministic steps as the ``final_checkpoint`` fixture (``perturb`` of the unsharded weights,
scattered into the shards), so vLLM must then compute exactly what a fresh vLLM loaded from that
checkpoint computes.

The ranks keep fp32 master shards and compute in bf16 (``MixedPrecisionPolicy``), as RL trainers
do; vLLM serves bf16, so every rank casts what it sends. Each master element is the step's bf16
value less a quarter of its last bf16 place: rounded to nearest it is that bf16 value again,
truncated it would be one place lower, so vLLM equals the fresh load only if the cast rounds.
"""

import datetime
import os
import sys

import torch


class _Wrapped:
    """A vLLM weight source of the user's own: the bridge cannot see the module behind it."""

    def __init__(self, source) -> None:
        self.source = source

    def metadata(self):
        return self.source.metadata()

    def __iter__(self):
        return iter(self.source)


def _a_quarter_place_below(bf16: "torch.Tensor") -> "torch.Tensor":
    """fp32 values that round to ``bf16`` but truncate to the bf16 value below it (zeros stay zero)."""
    exact = bf16.float()
    below = (exact.view(torch.int32) - 0x4000).view(torch.float32)  # 0.75 of a bf16 place above the one below
    return torch.where(exact == 0, exact, below)


def rank_main(rank: int, backend: str, model_dir: str, out: str, rounds: int, store: str, modes: list[str]) -> None:
    from wtransfer_vllm import LLMClient
    from wtransfer_vllm.testing import llm_kwargs

    llm = None
    if rank == 0:  # before the process group: vLLM's engine process must not inherit it
        from vllm import LLM

        llm = LLM(**llm_kwargs(model_dir, weight_transfer_config={"backend": backend}))
    try:
        _ranks_sync(rank, backend, model_dir, out, rounds, store, modes, llm, LLMClient(llm) if llm is not None else None)
    finally:  # a spawned process joins its children at exit: stop vLLM's engine first, error or not
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # never in place of the rank's own error
                print(f"rank 0: stopping vLLM's engine failed: {exc!r}", file=sys.stderr)


def _ranks_sync(rank: int, backend: str, model_dir: str, out: str, rounds: int, store: str, modes: list[str],
                llm, client) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor
    from vllm.distributed.weight_transfer.base import ModuleSource as VLLMModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    import vllm.plugins

    from wtransfer_vllm import trainer_init_info
    from wtransfer_vllm.testing import checksums, greedy, load_trainer_model, perturb, write_json

    vllm.plugins.load_general_plugins()  # a trainer rank without an LLM loads vLLM's plugins itself
    torch.set_num_threads(1)
    # a file, not a probed port: vLLM's start binds ports of its own in between
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (2,))  # CPU ranks even where CUDA is there (fully_shard's default)
    results = {}
    for mode in modes:
        unsharded = load_trainer_model(model_dir)  # the steps are taken here, then scattered into the shards
        model = load_trainer_model(model_dir).float()  # fp32 masters, bf16 compute
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        trainer = WeightTransferTrainerFactory.trainer_init(
            trainer_init_info(backend, rank=rank, sharded=True, world_size=2), client=client,
            source=VLLMModuleSource(model) if mode == "writes" else _Wrapped(VLLMModuleSource(model)),
        )
        whole = dict(unsharded.named_parameters())
        stats = []
        for step in range(rounds):
            perturb(unsharded, step)
            with torch.no_grad():
                for name, shard in model.named_parameters():
                    bf16 = distribute_tensor(whole[name].detach(), shard.device_mesh, shard.placements).to_local()
                    shard.to_local().copy_(_a_quarter_place_below(bf16))
            stats.append(trainer.send_weights())
            if rank == 0 and step == 0:  # a mode that moved nothing would leave the previous mode's outputs
                results[mode] = {"after_first": greedy(llm)}
        # the other rank's own stats: whether it wrote its shards is its own account
        results[mode] = {**results.get(mode, {}), "stats": stats}
        if rank == 0:
            results[mode].update(after=greedy(llm), checksums=checksums(llm), weight_version=llm.get_weight_version())
        trainer.shutdown()
        if llm is not None:
            llm.shutdown_weight_transfer_engine()
        write_json(out if rank == 0 else f"{out}.rank{rank}", results)  # each mode's as soon as it is done
        dist.barrier()  # the next mode's trainers start together
    dist.destroy_process_group()


if __name__ == "__main__":
    backend, model_dir, out, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    modes = sys.argv[5].split(",")
    if not modes or set(modes) - {"writes", "gathers"}:
        sys.exit(f"modes must be 'writes' and/or 'gathers', got {sys.argv[5]!r}")
    store = os.path.abspath(f"{out}.rendezvous")  # the ranks meet through a file that must not exist yet
    if os.path.exists(store):
        os.remove(store)
    torch.multiprocessing.spawn(rank_main, args=(backend, model_dir, out, rounds, store, modes), nprocs=2)
