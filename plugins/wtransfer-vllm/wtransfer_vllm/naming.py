"""Which names a wtransfer component gets in vLLM: small pure functions, no vLLM import.

The rule (one string everywhere): every component is registered under its qualified
wtransfer name ``distribution:name``; its bare name is added only where exactly one
installed distribution provides it and vLLM has no component of that name already.
So ``"shm"`` and ``"wtransfer:shm"`` both work, vLLM's own ``nccl`` stays vLLM's, and a
bare name two distributions provide is registered for neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_SEPARATORS = re.compile(r"[-_.]+")


def qualified_name(distribution: str, name: str) -> str:
    """``("Acme_WTransfer", "pipe")`` -> ``"acme-wtransfer:pipe"`` (PEP 503, as wtransfer spells it)."""
    return f"{_SEPARATORS.sub('-', distribution).lower()}:{name}"


@dataclass(frozen=True)
class Registration:
    """One name to register in a vLLM factory, and the wtransfer component it stands for."""

    vllm_name: str
    wtransfer_name: str  # always the qualified name: what the bridge asks wtransfer for


@dataclass(frozen=True)
class Skipped:
    """A bare name that is not registered, and why (logged at registration)."""

    name: str
    reason: str


def registration_plan(
    components: Iterable[tuple[str, str | None, str]], vllm_names: Iterable[str]
) -> tuple[list[Registration], list[Skipped]]:
    """Plan the names for one kind.

    ``components`` are ``(name, distribution, status)`` rows as ``wtransfer.list_components``
    gives them; runtime registrations (no distribution) and disabled components are left
    out: they are not visible in every process. ``vllm_names`` are the names vLLM already
    has (its built-ins and anything registered before the bridge).
    """
    taken = set(vllm_names)
    rows = [(name, dist) for name, dist, status in components if dist and status != "disabled"]
    providers: dict[str, list[str]] = {}
    for name, dist in rows:
        providers.setdefault(name, []).append(qualified_name(dist, name))
    plan: list[Registration] = []
    skipped: list[Skipped] = []
    for name, qualified in sorted(providers.items()):
        plan.extend(Registration(q, q) for q in sorted(set(qualified)))
        if len(set(qualified)) > 1:
            skipped.append(Skipped(name, f"provided by {', '.join(sorted(set(qualified)))}: use a qualified name"))
        elif name in taken:
            skipped.append(Skipped(name, f"vLLM already has {name!r}: use {qualified[0]!r} for wtransfer's"))
        else:
            plan.append(Registration(name, qualified[0]))
    return plan, skipped
