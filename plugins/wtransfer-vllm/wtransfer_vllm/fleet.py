"""Several vLLM instances behind one trainer, and a commit that says where each one stands.

A trainer drives one client; ``FleetClient`` is one client over several (offline ``LLM``s,
``vllm serve`` processes, Ray actors: any mix of clients), each instance's workers given their
own ranks. Its calls reach every instance at once (the workers of all of them join one
transport), and a round commits on each in turn of its own ``finish_weight_update``: that fan-out
is not atomic across instances (nothing can make it so without a second round trip every
instance waits on). So when an instance's commit fails, ``send_weights()`` raises
:class:`FleetCommitError` naming the version every instance now holds: the round's (committed),
the one before (its commit failed before loading), or none (torn: it refuses requests). The
trainer stays usable, and its next round brings every instance to one version.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import wtransfer


class FleetCommitError(wtransfer.TransferError):
    """A round's commit failed on some instances of a fleet; ``versions`` says what each holds."""

    def __init__(self, message: str, versions: list[str | None]) -> None:
        super().__init__(message)
        self.versions = versions
        """Per instance, the weight version it reports now (None: torn, or it could not say; the
        message tells which)."""


class FleetClient:
    """One ``WeightSyncClient`` over several vLLM instances.

    ``clients`` are the instances' clients (``LLMClient(llm)``, vLLM's
    ``HTTPVLLMWeightSyncClient(url)``, ...); ``workers`` how many workers each has (its tensor x
    pipeline parallel size; one number for all, or one per instance). The trainer's ``init_info``
    counts them all (``world_size`` = 1 + every instance's workers); each instance gets its own
    ``rank_offset`` (the trainer's, 1 by default, plus the workers of the instances before it).
    """

    def __init__(self, clients: Sequence[Any], workers: int | Sequence[int] = 1) -> None:
        self.clients = list(clients)
        if not self.clients:
            raise ValueError("FleetClient needs at least one client")
        counts = [workers] * len(self.clients) if isinstance(workers, int) else list(workers)
        if len(counts) != len(self.clients) or any(not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"FleetClient: workers must be one positive int, or one per client "
                             f"({len(self.clients)}), got {workers!r}")
        self.workers = counts

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        first = int(init_info.get("rank_offset", 1))
        offsets = [first + sum(self.workers[:index]) for index in range(len(self.clients))]
        needed = first + sum(self.workers)
        world_size = init_info.get("world_size")
        if isinstance(world_size, int) and world_size < needed:
            raise ValueError(f"FleetClient: init_info world_size {world_size} is too small for "
                             f"{sum(self.workers)} workers from rank_offset {first}: use {needed}")
        self._each("init_weight_transfer_engine", lambda index: ({**init_info, "rank_offset": offsets[index]},))

    def start_weight_update(self) -> None:
        self._each("start_weight_update", lambda index: ())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._each("update_weights", lambda index: (update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        failures = self._each("finish_weight_update", lambda index: (), raise_failures=False,
                              label=weight_version)
        if not failures:
            return
        reported = [weight_version_of(client) for client in self.clients]
        versions = [version for _, version in reported]
        states = []
        for index, (known, version) in enumerate(reported):
            if not known:
                state = "version unknown (its client cannot say)"
            elif version is None:
                state = "no version (torn: it refuses requests until a round commits on it)"
            elif weight_version is not None and version == weight_version:
                state = f"version {version} (committed)"
            elif index in failures:  # a call that timed out may still be loading the round there
                state = f"version {version} when asked (this round had not committed there yet)"
            else:
                state = f"version {version} (this round not committed)"
            states.append(f"instance {index}: {state}")
        causes = "; ".join(f"instance {index}: {type(exc).__name__}: {exc}" for index, exc in failures.items())
        raise FleetCommitError(
            f"round {weight_version}'s commit failed on {len(failures)} of {len(self.clients)} vLLM instances, "
            f"which now hold: {'; '.join(states)}. The trainer's next round brings every instance to one "
            f"version. Causes: {causes}", versions)

    def shutdown_weight_transfer_engine(self) -> None:
        self._each("shutdown_weight_transfer_engine", lambda index: (), missing_ok=True)

    def _each(self, method: str, args_for: Callable[[int], tuple[Any, ...]], raise_failures: bool = True,
              label: str | None = None, missing_ok: bool = False) -> dict[int, BaseException]:
        """``client.<method>(*args_for(index))`` on every instance at once (their workers may wait
        for each other inside the call); every call returns before this does."""
        from wtransfer.engines import accepts_weight_version

        failures: dict[int, BaseException] = {}

        def call(index: int, client: Any) -> None:
            function = getattr(client, method, None)
            if function is None and missing_ok:
                return
            try:
                if label is not None and accepts_weight_version(function):
                    function(*args_for(index), label)  # positionally, as the trainer calls a client
                else:
                    function(*args_for(index))
            except BaseException as exc:  # re-raised below, per instance
                failures[index] = exc

        threads = [threading.Thread(target=call, args=(index, client), name=f"wtransfer-fleet-{method}-{index}",
                                    daemon=True) for index, client in enumerate(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures and raise_failures:
            causes = "; ".join(f"instance {index}: {type(exc).__name__}: {exc}" for index, exc in failures.items())
            error = wtransfer.TransferError(f"client.{method}() failed on {len(failures)} of "
                                            f"{len(self.clients)} vLLM instances: {causes}")
            raise error from next(iter(failures.values()))
        return failures


def weight_version_of(client: Any) -> tuple[bool, str | None]:
    """Whether an instance said, and the weight version it reports (None: torn):
    ``client.get_weight_version()`` (``LLMClient``), or ``GET <base_url>/weight_info`` (vLLM's
    HTTP client)."""
    try:
        get = getattr(client, "get_weight_version", None)
        if callable(get):
            return True, get()
        base_url = getattr(client, "base_url", None)
        if isinstance(base_url, str):
            import requests

            return True, requests.get(f"{base_url}/weight_info", timeout=30).json().get("weight_version")
    except Exception:  # an instance that cannot answer: nothing to name
        return False, None
    return False, None
