"""What a test leaves behind in its process: threads, listening sockets, child processes, memfd mappings, and
``/dev/shm`` entries it holds open or mapped or that are named for wtransfer (Linux; the directory is the whole
host's, so others' entries are not counted). ``Resources.now()`` before, ``Resources.left_since(before)`` after: each leftover named.
Kept by design and not counted: wtransfer's fork server (it serves the whole run) and its process-wide copy pools.

wtransfer's own test suites check every test module with :func:`leaves_nothing_behind`; a plugin's suite does the
same by importing it into its ``conftest.py``::

    from wtransfer.testing.leaks import leaves_nothing_behind  # noqa: F401 - an autouse fixture, per module
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from wtransfer._probes import descendants, process_table, stat_fields


def _listening_inodes() -> set[str]:
    """Socket inodes in the LISTEN state, host-wide (TCP over IPv4 and IPv6, and Unix sockets)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # TCP_LISTEN
                inodes.add(fields[9])
    try:
        for line in Path("/proc/self/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 6 and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
                inodes.add(fields[6])
    except OSError:
        pass
    return inodes


def _fd_targets() -> dict[str, str]:
    targets = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            targets[entry] = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
    return targets


def dev_shm_held(pid: int | str = "self") -> dict[int, str]:
    """The ``/dev/shm`` files process ``pid`` holds open or mapped: inode -> the path it holds it by (a file may be
    held under a name it no longer has). Empty for a process that ended or is not ours to read."""
    held: dict[int, str] = {}
    # descriptors first: a file is opened, then mapped, then maybe closed, so one of the reads sees it held
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:  # one descriptor closing meanwhile must not hide the others
            path = os.readlink(f"/proc/{pid}/fd/{fd}")
            if path.startswith("/dev/shm/"):
                held[os.stat(f"/proc/{pid}/fd/{fd}").st_ino] = path
        except OSError:
            continue
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return held
    for line in lines:
        fields = line.split(None, 5)  # address perms offset device inode path
        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
            held[int(fields[4])] = fields[5]
    return held


def process_state(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent from ``/proc/<pid>/stat``; None when that cannot be read (it is gone).

    The state is ``"Z"`` for a zombie: it ended, but its parent did not reap it yet, so its pid
    still answers ``os.kill(pid, 0)``."""
    fields = stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[1]))


def running(pid: int) -> bool:
    """The process exists and has not ended (a zombie has)."""
    state = process_state(pid)
    return state is not None and state[0] != "Z"


def _live_descendants() -> dict[int, str]:
    """Live (not zombie) processes below this one: pid -> command line."""
    table = process_table()
    found = {}
    for pid in descendants(table, os.getpid()):
        if table[pid][0] == "Z":
            continue
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue
    return found


def _pool_threads() -> tuple[str, ...]:
    """Name prefixes of wtransfer's process-wide thread pools (copies, delta rounds): made once, kept by design."""
    import sys

    module = sys.modules.get("wtransfer.engines.rounds.packing")
    return tuple(f"{name}_" for name in getattr(module, "_pools", {}))


def _fork_servers() -> set[int]:
    """wtransfer's fork servers started by this process: they live for the whole run, by design."""
    import sys

    module = sys.modules.get("wtransfer._fork_server")
    if module is None:
        return set()
    servers = [module._current[1]] if module._current is not None else []
    return {server.process.pid for server in servers + list(module._retired)}


@dataclass(frozen=True)
class Resources:
    threads: frozenset[tuple[int, str]]
    listening: frozenset[str]  # fd -> "socket:[inode]" of listening sockets, as "fd socket:[inode]"
    memfds: frozenset[str]
    shm: frozenset[str]

    @classmethod
    def now(cls) -> Resources:
        targets = _fd_targets()
        listening = _listening_inodes()
        maps = Path("/proc/self/maps").read_text().splitlines()
        return cls(
            threads=frozenset((t.ident or 0, t.name) for t in threading.enumerate() if t.is_alive()),
            listening=frozenset(f"fd {fd} {target}" for fd, target in targets.items()
                                if target.startswith("socket:[") and target[8:-1] in listening),
            memfds=frozenset(line.split(None, 5)[-1] for line in maps if "/memfd:" in line) | frozenset(f"fd {fd} {t}" for fd, t in targets.items()
                                                               if t.startswith("/memfd:")),
            # /dev/shm is the whole host's (another test worker's vLLM holds entries there): the entries this
            # process holds open or mapped, and any named for wtransfer
            shm=frozenset(dev_shm_held().values())
            | (frozenset(f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if "wtransfer" in n)
               if os.path.isdir("/dev/shm") else frozenset()),
        )

    @classmethod
    def left_since(cls, before: Resources, grace_s: float = 10.0) -> list[str]:
        """What exists now and did not before, waiting up to ``grace_s`` for things that are ending (a thread
        joining, a child exiting); one line per leftover."""
        import gc

        deadline = time.monotonic() + grace_s
        while True:
            gc.collect()  # garbage is not a leak: a socket held only by a cycle (a traceback's frames) closes here
            now = cls.now()
            servers, pools = _fork_servers(), _pool_threads()
            children = {pid: cmd for pid, cmd in _live_descendants().items() if pid not in servers}
            left = [f"thread {name!r}" for _ident, name in sorted(now.threads - before.threads)
                    if not (pools and name.startswith(pools))]
            left += [f"listening socket ({item})" for item in sorted(now.listening - before.listening)]
            left += [f"memfd mapping {item}" for item in sorted(now.memfds - before.memfds)]
            left += [f"shared memory {name}" for name in sorted(now.shm - before.shm)]
            left += [f"child process {pid}: {cmd}" for pid, cmd in sorted(children.items())]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every module of the suite that imports this into its ``conftest.py``: nothing above outlives it."""
    before = Resources.now()
    yield
    left = Resources.left_since(before)
    assert not left, f"{request.module.__name__} left behind: " + "; ".join(left)
