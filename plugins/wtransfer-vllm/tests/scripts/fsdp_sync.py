"""FSDP2 trainer ranks with a real transformers model (tied embeddings) syncing two local workers.

Usage: fsdp_sync.py WORLD BACKEND MODEL_DIR OUT_JSON

Every rank loads the same Llama checkpoint (bf16, tied input/output embeddings), shards each
decoder layer and the root with ``fully_shard`` over a gloo default group, and takes ROUNDS
real AdamW steps; after each, every rank calls ``send_weights()`` (rank 0 sends to two worker
processes holding the unsharded transformers model). Rank 0 then compares the workers'
CRC32s with its own CRC32s of every parameter's whole value (``full_tensor()``, gathered on
every rank). Runs in the vLLM test environment because that is where transformers is.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import zlib

import torch

ROUNDS = 3


def crc(tensor: torch.Tensor) -> int:
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return zlib.crc32(raw.numpy()) if raw.numel() else 0


def rank_main(rank: int, world: int, backend: str, model_dir: str, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import wtransfer
    from wtransfer.local import LocalWorkerPool
    from wtransfer_vllm.testing import load_trainer_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    model = load_trainer_model(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the checkpoint should tie its embeddings"
    mesh = init_device_mesh("cpu", (world,))  # CPU ranks even where CUDA is there (fully_shard's default)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = None
    if rank == 0:
        pool = LocalWorkerPool(2, "wtransfer_vllm.testing:load_trainer_model", backend=backend,
                               factory_kwargs={"path": model_dir}, timeout_s=120, torch_threads=1)
    trainer = wtransfer.create_trainer(backend, client=pool, source=model, rank=rank,
                                       init_info={"world_size": 3, "timeout_s": 120} if rank == 0 else None)
    rounds = []
    for step in range(ROUNDS):
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = trainer.send_weights()
        whole = {}
        for name, parameter in model.named_parameters():  # a collective: every rank, same order
            with torch.no_grad():
                whole[name] = crc(parameter.full_tensor())
        if pool is not None:
            rounds.append({"version": stats["version"], "trainer": whole, "workers": pool.digests(),
                           "worker_versions": [s["weight_version"] for s in pool.stats()]})
    trainer.shutdown()
    if pool is not None:
        pool.shutdown()
        with open(out, "w") as handle:
            json.dump({"rounds": rounds}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, backend, model_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    store = os.path.abspath(f"{out}.rendezvous")  # the ranks meet through a file, not a probed port another process may take
    if os.path.exists(store):
        os.remove(store)
    torch.multiprocessing.spawn(rank_main, args=(world, backend, model_dir, store, out), nprocs=world)
