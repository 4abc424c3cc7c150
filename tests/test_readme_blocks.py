"""Every Python block of README.md and of the docs pages runs as written (each in its own
interpreter, from a file, so blocks that spawn processes work as they would for a user).
Outlines that need vLLM or a GPU are fenced as ```py and are not run. A block's temporary files (a
KV store made with ``tempfile.mkdtemp()``) go in its test's own folder, removed with it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, index, code) for page in PAGES
          for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


def test_the_readme_has_python_blocks() -> None:
    assert sum(page.name == "README.md" for page, _, _ in BLOCKS) >= 3


@pytest.mark.parametrize("page, index, code", BLOCKS,
                         ids=[f"{page.relative_to(ROOT)}:{index}" for page, index, _ in BLOCKS])
def test_python_block_runs_as_written(page: Path, index: int, code: str, tmp_path: Path) -> None:
    script = tmp_path / f"block_{index}.py"
    script.write_text(code)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(temporary)})
    where = page.relative_to(ROOT)
    assert out.returncode == 0, f"{where} python block {index} failed:\n{code[:400]}\n{out.stderr[-3000:]}"
