"""wtransfer's pytest11 plugin changes nothing in a project that does not use it.

Installing wtransfer loads :mod:`wtransfer.testing.plugin` into every pytest run on the machine.
A throwaway project (no conftest, nothing of wtransfer) is run with the plugin and with
``-p no:wtransfer``: its markers, its options and its tests' fixtures must be the same.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

THROWAWAY_TEST = '''
def test_prints_what_it_was_given(request):
    print("FIXTURES", sorted(request.fixturenames), "MARKS", [m.name for m in request.node.iter_markers()])
'''


def _pytest(project: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=project, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _throwaway(tmp_path: Path) -> Path:
    project = tmp_path / "unrelated"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: none of this repository's settings
    (project / "test_unrelated.py").write_text(THROWAWAY_TEST)
    return project


def _given(output: str) -> str:
    return next(line for line in output.splitlines() if "FIXTURES" in line)


def test_an_unrelated_project_runs_the_same_with_and_without_the_plugin(tmp_path: Path) -> None:
    """The same fixtures (no autouse one) and marks reach its test, and the plugin defines no
    pytest hook at all (none runs in anyone's session)."""
    import wtransfer.testing.plugin as plugin

    project = _throwaway(tmp_path)
    given = _given(_pytest(project, "-q", "-s"))
    assert given == _given(_pytest(project, "-q", "-s", "-p", "no:wtransfer"))
    assert "isolated_registry" not in given
    assert [name for name in vars(plugin) if name.startswith("pytest_")] == []


def test_the_plugin_adds_no_marker_and_no_option(tmp_path: Path) -> None:
    project = _throwaway(tmp_path)
    assert _pytest(project, "--markers") == _pytest(project, "--markers", "-p", "no:wtransfer")
    with_help = _pytest(project, "--help")
    without_help = _pytest(project, "--help", "-p", "no:wtransfer")
    assert with_help.replace("\n", " ") == without_help.replace("\n", " ")
    # and the comparisons compare two setups: installed, its fixtures are there for a test that
    # asks, and -p no:wtransfer names it (a renamed entry point would make them compare one)
    assert "fake_distribution" in _pytest(project, "--fixtures")
    assert "fake_distribution" not in _pytest(project, "--fixtures", "-p", "no:wtransfer")
