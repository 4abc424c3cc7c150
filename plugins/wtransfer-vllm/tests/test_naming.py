"""The naming rule, as pure functions (no vLLM needed)."""

from __future__ import annotations

from wtransfer_vllm.naming import Registration, qualified_name, registration_plan

VLLM = ["nccl", "ipc", "sparse_nccl"]


def names(plan: list[Registration]) -> dict[str, str]:
    return {r.vllm_name: r.wtransfer_name for r in plan}


def test_qualified_always_bare_where_unambiguous_and_free() -> None:
    plan, skipped = registration_plan(
        [("shm", "wtransfer", "available"), ("gloo", "wtransfer", "loaded"), ("nccl", "wtransfer-nccl", "available")],
        VLLM,
    )
    assert names(plan) == {
        "wtransfer:shm": "wtransfer:shm", "shm": "wtransfer:shm",
        "wtransfer:gloo": "wtransfer:gloo", "gloo": "wtransfer:gloo",
        "wtransfer-nccl:nccl": "wtransfer-nccl:nccl",  # vLLM's own nccl stays vLLM's
    }
    assert [(s.name, "vLLM already has" in s.reason) for s in skipped] == [("nccl", True)]


def test_two_providers_register_no_bare_name() -> None:
    plan, skipped = registration_plan(
        [("shm", "wtransfer", "conflict"), ("shm", "Acme_WT", "conflict"), ("pipe", "Acme_WT", "available")], VLLM
    )
    assert names(plan) == {"acme-wt:shm": "acme-wt:shm", "wtransfer:shm": "wtransfer:shm",
                           "acme-wt:pipe": "acme-wt:pipe", "pipe": "acme-wt:pipe"}
    assert skipped[0].name == "shm" and "acme-wt:shm" in skipped[0].reason and "wtransfer:shm" in skipped[0].reason


def test_runtime_and_disabled_components_are_not_registered() -> None:
    # A runtime registration lives in one process; a disabled one was blocked on purpose.
    plan, _ = registration_plan([("mine", None, "available"), ("gloo", "wtransfer", "disabled")], VLLM)
    assert plan == []


def test_qualified_name_is_pep503() -> None:
    assert qualified_name("Acme_WTransfer.Plugins", "x") == "acme-wtransfer-plugins:x"
