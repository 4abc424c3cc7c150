"""The leak check every test module runs names each kind of leftover, and says nothing once they are gone (a check
that cannot see a leak would pass every module)."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import threading

from wtransfer.testing.leaks import Resources


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
