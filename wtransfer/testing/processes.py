"""Run Python code in a fresh interpreter, the way a separate process sees installed plugins, and give the servers
such processes start a loopback port nothing else takes."""

from __future__ import annotations

import os
import random
import socket
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


def loopback_port() -> int:
    """A free port on 127.0.0.1 for a server another process binds later (``vllm serve``, a rank's store).

    A port from ``bind(("127.0.0.1", 0))`` lies in the kernel's ephemeral range, which every outgoing connection and
    every other ``bind(0)`` on the machine draws from: between the probe and the server's own bind (seconds, while
    vLLM imports) a neighbour can take it, and the server dies with "Address already in use". This one is drawn
    from 1024 up to that range (Linux's ``ip_local_port_range``), where only an explicit bind of the same number can
    take it; it is free on every address when returned. Without such a range to read, or with one that starts at
    1024 or below, it falls back to the probe and its race."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    draw = random.Random()  # its own seed: a test that seeds the global generator must not make every run collide
    for _ in range(100):
        with socket.socket() as probe:
            try:  # the wildcard address: taken on none, so a server may bind it on any
                probe.bind(("", draw.randrange(1024, low) if low > 1024 else 0))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError(f"no free port from 1024 to {low} after 100 draws")
