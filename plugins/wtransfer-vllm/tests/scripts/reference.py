"""A fresh vLLM instance loaded from a checkpoint: the outputs a sync must reproduce.

usage: reference.py MODEL_DIR OUT_JSON [LLM_KWARGS_JSON [THREADS]]

vLLM-CPU's kernels split their sums by thread count, so a reference computes with the threads of
the engine it is compared with. vLLM's default layout runs its worker in a process of its own,
bound by ``VLLM_CPU_OMP_THREADS_BIND`` ('auto' on a 2-core host: 1 thread, the other core set aside;
under xdist the suite's conftest gives each test process its own share of the cores); its engine
core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a faster start) keeps torch's default
(2 threads there). Seen on an AMD EPYC with AVX2: one logprob of 7 prompts off in its last bits
between the two, for one checkpoint of many. So in-process, this reference takes THREADS if
given (an engine that computed in its caller's process, e.g. TRL's colocated ``LLM``), else those
of the default layout's worker (one worker, no KV connector).
"""

import json
import os
import sys

import torch

from wtransfer_vllm.testing import checksums, greedy, llm_kwargs, write_json


def default_layout_threads() -> int:
    """The OpenMP threads vLLM's default (multiprocess) layout gives its one worker on this host,
    from vLLM's own binding code: what the synced engines compute with."""
    from types import SimpleNamespace

    from vllm.utils.ompmultiprocessing import OMPProcessManager

    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=0, _api_process_count=1)
    manager = OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=None))
    with manager.configure_omp_envs(rank=0, local_rank=0):  # sets OMP_NUM_THREADS unless told 'nobind'
        return int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))


if __name__ == "__main__":
    model_dir, out = sys.argv[1:3]
    kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    from vllm import LLM

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else default_layout_threads())
    elif len(sys.argv) > 4:
        raise SystemExit("THREADS applies to an in-process run (VLLM_ENABLE_V1_MULTIPROCESSING=0) only")
    llm = LLM(**llm_kwargs(model_dir, **kwargs))
    write_json(out, {"outputs": greedy(llm), "checksums": checksums(llm)})
