"""How wtransfer starts the processes it runs: pool workers, benchmark ranks, the kit's trainer.

Each is forked from a fork server that imported torch once (``spawn`` would import it again, seconds of CPU each,
hundreds of times per test run). Like ``spawn``, a child inherits none of the parent's state (threads, CUDA,
process groups); it gets the parent's ``sys.path``, working directory and current environment (passed as JSON).
What the server read at its own start stays as read: variables read at interpreter start or torch's import
(``OMP_NUM_THREADS``, ``LD_PRELOAD``), and torch itself. Without a fork server (Windows): ``spawn``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

PRELOAD = ("torch", "torch.distributed")
"""What the fork server imports once (only torch: wtransfer itself comes from the caller's path)."""


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first process)
    return context


def worker_process(target: Callable[..., Any], args: tuple[Any, ...] = (), *, name: str | None = None,
                   daemon: bool = True) -> multiprocessing.process.BaseProcess:
    """An unstarted process running ``target(*args)`` (a module-level function) with this process's environment as
    it is now."""
    return _context().Process(target=_run, args=(json.dumps(dict(os.environ)), target, args), name=name,
                              daemon=daemon)


def _run(environment: str, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(json.loads(environment))
    target(*args)
