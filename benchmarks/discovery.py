"""Discovery cost: ``import wtransfer`` against a bare interpreter, and wtransfer's whole discovery
(metadata scan + pluggy hook manager + many lookups) against one raw ``entry_points()`` scan.

Every figure comes from fresh interpreters, over a site directory with many extra
distributions (most with ordinary ``console_scripts``, a few with wtransfer entry points),
so the comparison is the one a real environment sees. Medians of interleaved runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.tables import table
from wtransfer._bench.report import add_report_arguments, figures_report
from wtransfer.testing.distributions import write_distribution

RAW_SCAN = """
import time, importlib.metadata as md
t = time.perf_counter(); md.entry_points(); print(time.perf_counter() - t)
"""

RAW_SCAN_WITH_IMPORT = """
import time
t = time.perf_counter()
import importlib.metadata as md
md.entry_points(); print(time.perf_counter() - t)
"""

# Library imports (importlib.metadata, pluggy) happen before the clock starts, as for RAW_SCAN;
# IMPORTS_INCLUDED below reports the cost with them.
WTRANSFER_DISCOVERY = """
import time, importlib.metadata, pluggy, wtransfer
from wtransfer._registry import manager, registry
names = {names!r}
t = time.perf_counter()
for i in range({lookups}):
    registry.registry_for("engines").resolve(names[i % len(names)])
print(time.perf_counter() - t)
"""

IMPORTS_INCLUDED = """
import time
t = time.perf_counter()
import wtransfer
from wtransfer._registry import registry
names = {names!r}
for i in range({lookups}):
    registry.registry_for("engines").resolve(names[i % len(names)])
print(time.perf_counter() - t)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dists", type=int, default=500, help="extra distributions on sys.path")
    parser.add_argument("--lookups", type=int, default=1000, help="name lookups per process")
    parser.add_argument("--repeat", type=int, default=15, help="fresh interpreters per measurement")
    add_report_arguments(parser)


def make_site(root: Path, count: int) -> list[str]:
    """``count`` distributions: one in fifty also declares a wtransfer engine. Returns engine names."""
    names = []
    for i in range(count):
        entry_points: dict[str, dict[str, str]] = {"console_scripts": {f"tool{i}": f"pkg{i}.cli:main"}}
        if i % 50 == 0:
            name = f"bench{i}"
            entry_points["wtransfer.engines"] = {name: f"pkg{i}.engine:Engine"}
            names.append(name)
        write_distribution(root, f"bench-dist-{i}", "1.0", entry_points)
    return names


def regular_install(root: Path) -> str:
    """A fresh virtual environment (no pip, nothing else installed) holding wtransfer as a regular install.

    The package's files are copied into the venv's site-packages and byte-compiled: what
    ``pip install wtransfer`` leaves there, minus metadata that ``import wtransfer`` never
    reads. An editable install would not do: its path hook imports ``typing`` at startup,
    so the bare interpreter pays what ``import wtransfer`` costs and the overhead hides.
    """
    import compileall
    import shutil

    import wtransfer

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    target = Path(purelib) / "wtransfer"
    shutil.copytree(Path(wtransfer.__file__).parent, target, ignore=shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(str(target), quiet=1)
    return python


def _time_child(code: str, site: Path | None) -> float:
    env_path = [str(site)] if site else []
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(env_path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _time_process(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def measure(dists: int, lookups: int, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="wtransfer-bench-discovery-") as tmp:
        site = Path(tmp)
        fresh = regular_install(site / "fresh")
        names = make_site(site, dists) + ["shm", "gloo"]
        kinds = ("bare", "import", "bare_here", "import_here", "raw_scan", "discovery", "raw_with_import", "with_imports")
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(repeat):  # interleaved, so drift on a noisy machine hits all equally
            samples["bare"].append(_time_process([fresh, "-c", "pass"]))
            samples["import"].append(_time_process([fresh, "-c", "import wtransfer"]))
            samples["bare_here"].append(_time_process([sys.executable, "-c", "pass"]))
            samples["import_here"].append(_time_process([sys.executable, "-c", "import wtransfer"]))
            samples["raw_scan"].append(_time_child(RAW_SCAN, site))
            samples["discovery"].append(_time_child(WTRANSFER_DISCOVERY.format(names=names, lookups=lookups), site))
            samples["raw_with_import"].append(_time_child(RAW_SCAN_WITH_IMPORT, site))
            samples["with_imports"].append(_time_child(IMPORTS_INCLUDED.format(names=names, lookups=lookups), site))
    return {k: statistics.median(v) * 1000 for k, v in samples.items()}


def run(args: argparse.Namespace) -> int:
    with figures_report(args, "discovery", markdown) as result:
        ms = measure(args.dists, args.lookups, args.repeat)
        result.update({
            "dists": args.dists,
            "lookups": args.lookups,
            "repeat": args.repeat,
            "bare_interpreter_ms": ms["bare"],
            "import_wtransfer_ms": ms["import"],
            "import_overhead_ms": ms["import"] - ms["bare"],
            "this_environment_bare_ms": ms["bare_here"],
            "this_environment_import_ms": ms["import_here"],
            "raw_entry_points_scan_ms": ms["raw_scan"],
            "wtransfer_discovery_ms": ms["discovery"],
            "discovery_ratio": ms["discovery"] / ms["raw_scan"],
            "discovery_with_imports_ms": ms["with_imports"],
            "raw_scan_with_import_ms": ms["raw_with_import"],
            "with_imports_ratio": ms["with_imports"] / ms["raw_with_import"],
        })
        if not args.json and args.markdown is None:
            from rich.console import Console
            from rich.table import Table

            made = Table(title=_title(result))
            for column in COLUMNS:
                made.add_column(column)
            for row in _rows(result):
                made.add_row(*row)
            Console().print(made)
    return 0


COLUMNS = ("measurement", "time", "vs reference", "target")
IMPORT_TARGET_MS = 5.0
"""``import wtransfer`` over a bare interpreter, regular install (DESIGN's number)."""


def _title(result: dict[str, Any]) -> str:
    return (f"discovery cost (medians of {result['repeat']} fresh interpreters; {result['dists']} extra "
            f"distributions installed, {result['lookups']} lookups)")


def _rows(result: dict[str, Any]) -> list[list[str]]:
    return [
        ["fresh venv, regular install: python -c pass", f"{result['bare_interpreter_ms']:.1f} ms", "", ""],
        ["fresh venv, regular install: python -c 'import wtransfer'", f"{result['import_wtransfer_ms']:.1f} ms",
         f"+{result['import_overhead_ms']:.1f} ms", f"≤ +{IMPORT_TARGET_MS:g} ms"],
        ["this environment: python -c 'import wtransfer' (vs its python -c pass)",
         f"{result['this_environment_import_ms']:.1f} ms",
         f"+{result['this_environment_import_ms'] - result['this_environment_bare_ms']:.1f} ms", "(informative)"],
        ["raw importlib.metadata.entry_points()", f"{result['raw_entry_points_scan_ms']:.1f} ms", "1.00×", ""],
        ["wtransfer discovery + lookups", f"{result['wtransfer_discovery_ms']:.1f} ms",
         f"{result['discovery_ratio']:.2f}×", "≤ 1.10×"],
        ["cold: import importlib.metadata + raw scan", f"{result['raw_scan_with_import_ms']:.1f} ms", "1.00×", ""],
        ["cold: import wtransfer (+ pluggy, importlib.metadata) + discovery + lookups",
         f"{result['discovery_with_imports_ms']:.1f} ms", f"{result['with_imports_ratio']:.2f}×", "(informative)"],
    ]


def markdown(result: dict[str, Any]) -> list[str]:
    return table(_title(result), list(COLUMNS), _rows(result))
