"""Hook implementations: record every engine creation (the tests read the file)."""

from __future__ import annotations

import os

import wtransfer


@wtransfer.hookimpl
def wtransfer_engine_created(engine) -> None:
    log = os.environ.get("WTRANSFER_EXAMPLE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"created {type(engine).__name__}\n")
