"""``python -m benchmarks SUITE [options]`` from the repository's root (``--help`` for each suite)."""

import os
import sys
from pathlib import Path

from benchmarks import SUITES
from wtransfer.cli.bench import run_suite

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(f"usage: python -m benchmarks SUITE [options]\nsuites: {', '.join(SUITES)}")
        sys.exit(0 if len(sys.argv) > 1 else 2)
    root = str(Path(__file__).resolve().parent.parent)  # worker processes import benchmarks.* too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    sys.exit(run_suite(sys.argv[1:], SUITES, None, "python -m benchmarks", elsewhere=""))
