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
    fd = os.memfd_create("wtransfer-leak-probe")
    os.ftruncate(fd, 4096)
    mapping = mmap.mmap(fd, 4096)
    try:
        left = "; ".join(Resources.left_since(before, grace_s=0.2))
        assert "thread 'leak-probe-thread'" in left, left
        assert f"listening socket (fd {listener.fileno()} " in left, left
        assert f"child process {child.pid}: sleep 60" in left, left
        assert "/dev/shm/wtransfer-leak-probe" in left, left
        assert "/memfd:wtransfer-leak-probe" in left, left
    finally:
        stop.set()
        thread.join(10)
        listener.close()
        child.kill()
        child.wait()
        os.unlink(shm)
        mapping.close()
        os.close(fd)
    assert Resources.left_since(before) == []
