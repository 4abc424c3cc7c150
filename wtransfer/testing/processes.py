"""Run Python code in a fresh interpreter, the way a separate process sees installed plugins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_python(
    code: str,
    *,
    path: Sequence[str | Path] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) with ``path`` prepended to ``PYTHONPATH``; return the finished process. With
    ``check`` a non-zero exit raises ``AssertionError`` showing stdout and stderr."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    entries = [str(p) for p in path]
    if full_env.get("PYTHONPATH"):
        entries.append(full_env["PYTHONPATH"])
    full_env["PYTHONPATH"] = os.pathsep.join(entries)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc
