"""Small pure functions about names: normalising, qualifying, suggesting."""

from __future__ import annotations

import re

_SEPARATORS = re.compile(r"[-_.]+")


def normalize_distribution(name: str) -> str:
    """PEP 503 normalisation, so ``Wtransfer_NCCL`` and ``wtransfer-nccl`` are the same."""
    return _SEPARATORS.sub("-", name).lower()


def split_qualified(name: str) -> tuple[str | None, str]:
    """``"wtransfer-nccl:nccl"`` -> ``("wtransfer-nccl", "nccl")``; ``"shm"`` -> ``(None, "shm")``."""
    if ":" in name:
        distribution, _, bare = name.rpartition(":")
        return normalize_distribution(distribution), bare
    return None, name


def qualify(distribution: str | None, name: str) -> str:
    return f"{normalize_distribution(distribution)}:{name}" if distribution else name


def suggest(name: str, candidates: list[str], limit: int = 3) -> list[str]:
    """Close matches for a mistyped name ("did you mean ...")."""
    import difflib  # only on the error path

    lowered = {c.lower(): c for c in candidates}
    matches = difflib.get_close_matches(name.lower(), list(lowered), n=limit, cutoff=0.6)
    return [lowered[m] for m in matches]
