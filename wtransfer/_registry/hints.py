"""Known backends that live in separately installed distributions: when one is asked for but not installed, the
error says what to install instead of only "unknown name"."""

from __future__ import annotations

from typing import TypedDict


class InstallHint(TypedDict):
    distribution: str
    install: str
    note: str


KNOWN_BACKENDS: dict[tuple[str, str], InstallHint] = {
    ("engines", "nccl"): {
        "distribution": "wtransfer-nccl",
        "install": "pip install wtransfer-nccl  (from a source checkout: pip install ./plugins/wtransfer-nccl)",
        "note": "NCCL weight transfer between CUDA devices",
    },
}


def install_hint(kind: str, name: str) -> InstallHint | None:
    return KNOWN_BACKENDS.get((kind, name))
