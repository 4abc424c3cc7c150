"""Throwaway virtual environments for tests that pip-install a distribution for real.

``layered_venv`` makes an environment that sees every package of the running one, the
way ``--system-site-packages`` is often assumed to work. It does not, from inside a
virtual environment: ``venv --system-site-packages`` layers the new environment on the
*base* interpreter, so torch and wtransfer vanish. Here a ``.pth`` file calls
``site.addsitedir`` on the running environment's site directories instead (which also
runs their own ``.pth`` files, so editable installs keep working).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=120,
    )
    return Path(out.stdout.strip())


def layered_venv(root: Path) -> Path:
    """A new virtual environment at ``root`` that also sees the running environment's packages.

    Packages installed into it shadow the running ones (its own site directory comes first).
    Returns its python.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
    python = root / "bin" / "python"
    parents = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    lines = "".join(f"import site; site.addsitedir({path!r})\n" for path in parents)
    (_site_packages(python) / "_wtransfer_parent_env.pth").write_text(lines)
    return python


def pip(python: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the running interpreter's pip against ``python``'s environment; on failure the
    error shows pip's own output, not just its exit status."""
    command = [sys.executable, "-m", "pip", "--python", str(python), *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(
            f"pip failed (exit {out.returncode}): {' '.join(command)}\n"
            f"--- stdout ---\n{out.stdout[-4000:]}\n--- stderr ---\n{out.stderr[-4000:]}"
        )
    return out
