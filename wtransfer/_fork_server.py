"""How wtransfer starts the processes it runs: pool workers, benchmark ranks, the kit's trainer.

Each is forked from a fork server that imported torch once (a fresh interpreter would import it again, seconds of
CPU each, hundreds of times per test run). The server is wtransfer's own, not multiprocessing's, so that

* a child's stdin is ``/dev/null`` and its stdout/stderr are the caller's descriptors 1 and 2 *as they are when
  the child starts* (a redirect made later reaches later children);
* the caller's environment is in force before anything is imported: a child sets the caller's ``os.environ``
  before it imports its target, and a server runs only while the caller's environment is the one it started
  with (a changed one starts a new server, the old one ends once its children did), so even what torch and the
  C libraries read at start (``OMP_NUM_THREADS``, ``LD_PRELOAD``) is the caller's;
* nothing is pickled: the server gets JSON (the target as ``"module:function"``, JSON arguments, the working
  directory, ``sys.path`` and the environment) and descriptors (stdio, the caller's pipe ends) over a Unix socket;
  a target or a model factory named ``"__main__:..."`` has the caller's script run first, as ``__mp_main__``
  (its ``if __name__ == "__main__":`` part does not run), as multiprocessing's ``spawn`` does;
* a child is tracked through a pidfd: ``is_alive()``, ``kill()`` and ``join()`` act on that very process even
  when the server died, so no child outlives its handle unnoticed;
* no process-wide ``multiprocessing`` setting is changed.

Without pidfds (not Linux, or Linux before 5.3): ``spawn``, which pickles the target and its arguments to start the
child.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

PRELOAD = ("torch", "torch.distributed")
"""What a fork server imports once (only torch: wtransfer itself comes from the caller's path)."""
_MESSAGE = 1 << 20
UNKNOWN_EXIT = 255
"""``exitcode`` of a child that ended after its fork server died (no one was left to tell how it ended)."""


class _Server:
    """One fork server process, started with one environment."""

    def __init__(self, environment: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); import wtransfer._fork_server as f; f.serve()"
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(sys.path), str(theirs.fileno())], env=environment,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        self.sock = ours
        self.lock = threading.Lock()
        self.retired = False

    def fork(self, request: dict[str, Any], fds: list[int], timeout_s: float) -> tuple[int, int] | None:
        """Start one child; its pid and a pidfd for it (None: this server was retired meanwhile, ask the next).

        A server that does not answer within ``timeout_s`` (stuck importing torch at its start) is killed, not
        retired: retired, it would still fork this request once it got unstuck, a child no one holds."""
        with self.lock:
            if self.retired:
                return None
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
                answered = _readable(self.sock.fileno(), timeout_s)
                if answered:
                    data, received, _flags, _addr = socket.recv_fds(self.sock, _MESSAGE, 1)
            except OSError as exc:
                answered, data, received = True, b"", []
                cause: BaseException | None = exc
            else:
                cause = None
            if not answered:
                self._stop()
                raise TimeoutError(
                    f"wtransfer's fork server (pid {self.process.pid}) did not answer within {timeout_s:g} s, "
                    f"so it was stopped and the process was not started. A server imports "
                    f"{', '.join(PRELOAD)} when it starts: check that `{sys.executable} -c 'import torch'` "
                    f"finishes in this environment, or allow more time (start_timeout_s)")
        reply = json.loads(data) if data else {}
        if "error" in reply:
            raise RuntimeError(f"wtransfer's fork server could not start the process: {reply['error']}")
        if not received:
            raise RuntimeError(f"wtransfer's fork server (pid {self.process.pid}) is gone "
                               f"(exit code {self.process.poll()}); the process was not started") from cause
        return int(reply["pid"]), received[0]

    def _stop(self) -> None:
        """Kill this server now (the lock held); the children it started are still reached through their pidfds,
        and read ``UNKNOWN_EXIT`` once they end."""
        self.retired = True
        self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        with contextlib.suppress(OSError):  # it forked the request just before it was killed: that child goes too
            self.sock.setblocking(False)  # (socket.recv_fds drops its flags, MSG_DONTWAIT too, before Python 3.12)
            _data, late, _flags, _addr = socket.recv_fds(self.sock, _MESSAGE, 1)
            for pidfd in late:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
        self.sock.close()

    def retire(self) -> None:
        """No more children from this server: it exits once its last child ended and was reported."""
        with self.lock:  # a start under way completes first
            self.retired = True
            with contextlib.suppress(OSError):
                self.sock.close()
        _retired.append(self)


VOLATILE = ("PYTEST_CURRENT_TEST",)
"""Variables that change all the time and matter to no import: a change of only these keeps the server."""
_current: tuple[str, _Server] | None = None  # the server for one environment (a key), or none yet
_servers_lock = threading.Lock()
_children: set[ForkedProcess] = set()  # started and not closed: a daemonic one is ended at exit, whoever holds it
_retired: list[_Server] = []


def _environment() -> dict[str, str]:
    """A copy of ``os.environ``. ``dict(os.environ)`` lists the names, then reads each: a variable another thread
    unsets in between raises ``KeyError``, so such a copy is taken again."""
    while True:
        try:
            return dict(os.environ)
        except KeyError:
            continue


def _server(environment: dict[str, str]) -> _Server:
    """The server for ``environment`` (the caller's, as a start copied it): the current one, or a new one."""
    key = json.dumps({k: v for k, v in environment.items() if k not in VOLATILE}, sort_keys=True)
    global _current
    with _servers_lock:
        _retired[:] = [server for server in _retired if server.process.poll() is None]  # reaps those that ended
        if (_current is None or _current[0] != key or _current[1].retired
                or _current[1].process.poll() is not None):
            if _current is not None:
                _current[1].retire()
            _current = (key, _Server(environment))
        return _current[1]


def _readable(fd: int, timeout_s: float | None) -> bool:
    """``fd`` (a pidfd or a pipe) is readable within ``timeout_s`` (None: wait as long as it takes)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(timeout_s, 0.0) * 1000))


@functools.cache
def _pidfds_work() -> bool:
    """This kernel has pidfds (Linux 5.3 and later): a Python build may have ``os.pidfd_open`` without them."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


@atexit.register
def _at_exit() -> None:
    """As multiprocessing does: daemonic children end with their caller; then the servers stop."""
    with _servers_lock:
        daemonic = [c for c in list(_children) if c.daemon]
    for child in daemonic:
        if child.is_alive():
            child.terminate()
            child.join(2)
            if child.is_alive():
                child.kill()
    global _current
    with _servers_lock:
        if _current is not None:
            _current[1].retire()
            _current = None
    for server in _retired:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(1)


def reference(function: Callable[..., Any]) -> str:
    """``"module:qualname"`` of a module-level function: how a new process names what to import."""
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not module or "<" in qualname:
        raise ValueError(f"{function!r} must be a module-level function (not a lambda or a closure) so a new "
                         f"process can import it; or pass 'package.module:function'")
    return f"{module}:{qualname}"


def _main_script() -> dict[str, str] | None:
    """How a child runs the caller's ``__main__`` (as ``__mp_main__``, so its ``if __name__ == "__main__":`` part
    does not run): a script's path, or the module of ``python -m``. None: interactive or ``-c``."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name:
        return {"name": name}
    path = getattr(main, "__file__", None)
    return {"path": os.path.abspath(path)} if path else None


class ForkedProcess:
    """A child of a fork server, with the part of ``multiprocessing.Process``'s interface wtransfer uses."""

    def __init__(self, target: Callable[..., Any], args: tuple[Any, ...], name: str | None, daemon: bool,
                 start_timeout_s: float) -> None:
        self._reference = reference(target)
        self._start_timeout_s = start_timeout_s
        self._args = args
        self.name = name or self._reference
        self.daemon = daemon
        self.pid: int | None = None
        self.sentinel: int = -1
        """A pidfd: readable once the process ended (for ``multiprocessing.connection.wait``)."""
        self._status: int = -1
        self._exitcode: int | None = None
        self._lock = threading.Lock()  # the status is read once

    def start(self) -> None:
        fds, arguments = [], []
        for arg in self._args:
            if isinstance(arg, Connection):
                arguments.append({"connection": len(fds), "readable": arg.readable, "writable": arg.writable})
                fds.append(arg.fileno())
            else:
                arguments.append({"value": arg})
        environment = _environment()  # one copy: the server is chosen by the environment the child gets
        status_r, status_w = os.pipe()
        request = {"target": self._reference, "args": arguments, "cwd": os.getcwd(), "path": sys.path,
                   "environment": environment, "name": self.name, "main": None}
        if any(isinstance(item, str) and item.startswith("__main__:") for item in (self._reference, *self._args)):
            request["main"] = _main_script()  # the target, or a factory it imports, lives in the caller's script
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            started = None
            while started is None:  # None: the server was retired while this start waited for it
                started = _server(environment).fork(request, [1, 2, status_w, *fds], self._start_timeout_s)
            self.pid, self.sentinel = started
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        self._status = status_r
        _children.add(self)

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit code (negative: the signal that ended it) once it ended."""
        with self._lock:
            if self._exitcode is None and self.sentinel >= 0 and _readable(self.sentinel, 0):
                self._exitcode = self._read_status()
                _children.discard(self)  # ended: nothing left to end at exit (an unclosed handle is collected)
            return self._exitcode

    def _read_status(self) -> int:
        # the server writes it once it reaped the child, a moment after the pidfd turned readable
        if not _readable(self._status, 5.0):
            return UNKNOWN_EXIT
        data = os.read(self._status, 16)
        return int(data) if data else UNKNOWN_EXIT

    def is_alive(self) -> bool:
        return self.pid is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self.sentinel >= 0 and self._exitcode is None:
            _readable(self.sentinel, timeout)

    def _signal(self, number: int) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.sentinel, number)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        """Release the pidfd and the status pipe (the process must have ended)."""
        if self.is_alive():
            raise ValueError(f"cannot close {self.name} (pid {self.pid}): it is still running")
        _children.discard(self)
        self._release()

    def _release(self) -> None:
        with self._lock:
            for fd in (self.sentinel, self._status):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self.sentinel = self._status = -1

    def __del__(self) -> None:
        self._release()  # closed or never started (a started one is held in _children until closed)


def worker_process(target: Callable[..., Any], args: tuple[Any, ...] = (), *, name: str | None = None,
                   daemon: bool = True, start_timeout_s: float = 120.0) -> Any:
    """An unstarted process running ``target(*args)``: ``target`` a module-level function, ``args`` JSON values or
    ``multiprocessing`` pipe ends. A daemonic one is ended when this process exits. ``start()`` raises
    ``TimeoutError`` when the fork server does not answer within ``start_timeout_s`` (it imports torch first)."""
    if not _pidfds_work():  # pragma: no cover - not Linux, or a kernel before 5.3
        import multiprocessing

        return multiprocessing.get_context("spawn").Process(target=target, args=args, name=name, daemon=daemon)
    return ForkedProcess(target, args, name, daemon, start_timeout_s)


# -- the server's side -----------------------------------------------------------------------------------------
def serve() -> None:
    """The fork server's main loop: fork a child per request, report each child's exit status; exit when the
    caller's end of the socket closes."""
    import importlib
    import selectors

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the caller; it ends the children it wants
    sock = socket.socket(fileno=int(sys.argv[2]))
    for module in PRELOAD:
        importlib.import_module(module)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    while selector.get_map():  # the caller's socket (until it closes) and one pidfd per running child
        for key, _events in selector.select():
            if key.fileobj is not sock:
                pid, pidfd, status_w = key.data
                selector.unregister(pidfd)
                _pid, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    os.write(status_w, str(os.waitstatus_to_exitcode(status)).encode())
                os.close(status_w)
                os.close(pidfd)
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, _MESSAGE, 64)
            if not data:  # retired, or the caller exited: report the children that run, then exit
                selector.unregister(sock)
                continue
            stdout, stderr, status_w, *arg_fds = fds
            try:
                pid = os.fork()
            except OSError as exc:  # out of processes or memory: the caller hears why
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    sock.send(json.dumps({"error": f"fork failed: {exc}"}).encode())
                continue
            if pid == 0:
                selector.close()
                _child(json.loads(data), sock, stdout, stderr, arg_fds)  # never returns
            for fd in (stdout, stderr, *arg_fds):
                os.close(fd)
            pidfd = os.pidfd_open(pid)  # cannot fail for a child not yet reaped
            with contextlib.suppress(OSError):  # a caller gone meanwhile: the child is reported all the same
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
            selector.register(pidfd, selectors.EVENT_READ, (pid, pidfd, status_w))


def _child(request: dict[str, Any], sock: socket.socket, stdout: int, stderr: int, arg_fds: list[int]) -> None:
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        keep = set(arg_fds)
        for entry in os.listdir("/proc/self/fd"):  # the server's other descriptors are none of this child's
            fd = int(entry)
            if fd > 2 and fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.environ.clear()
        os.environ.update(request["environment"])
        os.chdir(request["cwd"])
        sys.path[:] = request["path"]
        if request["main"] is not None:
            import runpy
            import types

            main = types.ModuleType("__mp_main__")
            found = request["main"]
            main.__dict__.update(runpy.run_module(found["name"], run_name="__mp_main__", alter_sys=True)
                                 if "name" in found else runpy.run_path(found["path"], run_name="__mp_main__"))
            sys.modules["__main__"] = sys.modules["__mp_main__"] = main
        from wtransfer._registry.loading import import_target

        target = import_target(request["target"])
        args = [Connection(arg_fds[a["connection"]], a["readable"], a["writable"]) if "connection" in a
                else a["value"] for a in request["args"]]
        target(*args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # its non-daemon threads end, as in any process
        with contextlib.suppress(BaseException):
            _at_exit()  # the daemonic children it started end with it
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
