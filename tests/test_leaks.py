"""The leak check every test module runs names each kind of leftover, and says nothing once they are gone (a check
that cannot see a leak would pass every module)."""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import subprocess
import sys
import threading

from wtransfer.testing.leaks import Resources, dev_shm_held


def test_each_kind_of_leftover_is_named_and_nothing_once_cleaned() -> None:
    before = Resources.now()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="leak-probe-thread", daemon=True)
    thread.start()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    child = subprocess.Popen(["sleep", "60"])
    shm = "/dev/shm/wtransfer-leak-probe"
    open(shm, "w").close()
    held = open("/dev/shm/leak-probe-held", "w+b")  # any name, held open and mapped (as torch's segments are)
    held.truncate(4096)
    held_map = mmap.mmap(held.fileno(), 4096)
    not_ours = "/dev/shm/leak-probe-not-ours"  # as another process's entry: nothing here holds it
    open(not_ours, "w").close()
    fd = os.memfd_create("wtransfer-leak-probe")
    os.ftruncate(fd, 4096)
    mapping = mmap.mmap(fd, 4096)
    cycle: list = []
    garbage = socket.socket()  # listening, but held only by a reference cycle: collected, not leaked
    garbage.bind(("127.0.0.1", 0))
    garbage.listen()
    cycle += [cycle, garbage]
    garbage_fd = garbage.fileno()
    del cycle, garbage
    try:
        left = "; ".join(Resources.left_since(before, grace_s=0.2))
        assert "thread 'leak-probe-thread'" in left, left
        assert f"listening socket (fd {listener.fileno()} " in left, left
        assert f"listening socket (fd {garbage_fd} " not in left, left
        assert f"child process {child.pid}: sleep 60" in left, left
        assert "shared memory /dev/shm/wtransfer-leak-probe" in left, left
        assert "shared memory /dev/shm/leak-probe-held" in left, left
        assert "leak-probe-not-ours" not in left, left
        assert "/memfd:wtransfer-leak-probe" in left, left
    finally:
        stop.set()
        thread.join(10)
        listener.close()
        child.kill()
        child.wait()
        os.unlink(shm)
        os.unlink(not_ours)
        held_map.close()
        held.close()
        os.unlink("/dev/shm/leak-probe-held")
        mapping.close()
        os.close(fd)
    assert Resources.left_since(before) == []


HOLDER = """
import ctypes, os, sys
opened = open(sys.argv[1], "w+b")  # held open only
fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT)  # held mapped only (Python's mmap would keep a descriptor)
os.ftruncate(fd, 4096)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
address = libc.mmap(None, 4096, 3, 1, fd, 0)  # PROT_READ | PROT_WRITE, MAP_SHARED
if address in (None, ctypes.c_void_p(-1).value):
    raise OSError(ctypes.get_errno(), "mmap failed")
os.close(fd)
os.link(sys.argv[2], sys.argv[2] + "-link")  # the mapping's name goes; the file lives on under another
os.unlink(sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
"""


def test_dev_shm_held_sees_another_process_files_open_or_only_mapped_by_inode() -> None:
    """The vLLM tests' sweep removes a /dev/shm file only when no process holds it: a file held by descriptor only, and
    one only mapped under a name it no longer has (maps says "(deleted)"; it lives on under a link), must both count as
    held, and a process that ended holds nothing."""
    opened, mapped, loose = (f"/dev/shm/leak-probe-{what}-{os.getpid()}" for what in ("open", "mapped", "loose"))
    open(loose, "w").close()
    child = subprocess.Popen([sys.executable, "-c", HOLDER, opened, mapped], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout.readline().strip() == "ready", "the holder did not start"
        held = dev_shm_held(child.pid)
        assert os.stat(opened).st_ino in held and held[os.stat(opened).st_ino] == opened, held
        assert os.stat(mapped + "-link").st_ino in held, held  # no descriptor, mapped under a name gone since
        assert os.stat(loose).st_ino not in held, held
    finally:
        child.kill()
        child.wait()
        for path in (opened, mapped, mapped + "-link", loose):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert dev_shm_held(child.pid) == {}
