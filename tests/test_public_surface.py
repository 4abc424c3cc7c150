"""The plugin author's surface: what plugins may import, enforced on the plugins we ship.

``PUBLIC_MODULES`` is the promise (README's plugin guide lists the same). Everything else
lives in ``_``-modules. The checks read the import statements of ``plugins/`` and of the
example plugin, as a third party's code would be read, and can fail: the first test feeds
the checker imports of private modules and requires it to flag each one.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PUBLIC_MODULES = {
    "wtransfer",
    "wtransfer.config",
    "wtransfer.errors",
    "wtransfer.kvcache",
    "wtransfer.local",
    "wtransfer.options",
    # the three toolkits, and the built-ins that may be derived from
    "wtransfer.engines",
    "wtransfer.engines.shm",
    "wtransfer.engines.gloo",
    "wtransfer.connectors",
    "wtransfer.connectors.storage",
    "wtransfer.connectors.multi",
    "wtransfer.connectors.offloading",
    "wtransfer.specs",
    "wtransfer.specs.cpu",
    "wtransfer.specs.policies",
    # test helpers and conformance suites for plugin test suites
    "wtransfer.testing",
    "wtransfer.testing.conformance",
    "wtransfer.testing.distributions",
    "wtransfer.testing.models",
    "wtransfer.testing.venvs",
}
TOOLKITS = ("wtransfer", "wtransfer.engines", "wtransfer.connectors", "wtransfer.specs")


def wtransfer_imports(source: str) -> list[str]:
    """Every ``wtransfer`` module a source file imports (statements and ``import_module`` strings)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            # `from wtransfer.engines import _trainer` names a module too
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(node.args[0].value)
    return [name for name in found if name == "wtransfer" or name.startswith("wtransfer.")]


def private_imports(source: str) -> list[str]:
    return [name for name in wtransfer_imports(source) if name not in PUBLIC_MODULES]


def plugin_sources() -> list[Path]:
    roots = [*sorted((ROOT / "plugins").iterdir()), ROOT / "tests" / "example_plugin"]
    files = []
    for root in roots:
        files += [p for p in root.rglob("*.py")
                  if not {"build", "dist"} & set(p.relative_to(root).parts) and ".egg-info" not in str(p)]
    return files


def test_the_checker_flags_private_imports():
    broken = '''
import wtransfer._registry.registry
from wtransfer.engines._trainer import MIB
from wtransfer.engines import _protocol
from wtransfer.cli import main
import importlib; importlib.import_module("wtransfer.connectors._base")
'''
    assert private_imports(broken) == [
        "wtransfer._registry.registry", "wtransfer.engines._trainer", "wtransfer.engines._protocol",
        "wtransfer.cli", "wtransfer.connectors._base",
    ]
    assert private_imports("import wtransfer\nfrom wtransfer.engines import MIB, SharedMemoryTrainer\n") == []


@pytest.mark.parametrize("path", plugin_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_the_public_surface(path):
    assert private_imports(path.read_text()) == [], (
        f"{path.relative_to(ROOT)} imports private wtransfer modules; use the toolkits "
        f"({', '.join(TOOLKITS)}) instead"
    )


def test_plugin_sources_were_found():
    names = {p.name for p in plugin_sources()}
    assert {"engine.py", "fifo.py", "connector.py", "registration.py"} <= names


@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_public_modules_exist_and_are_not_underscored(module):
    assert not any(part.startswith("_") for part in module.split("."))
    importlib.import_module(module)


@pytest.mark.parametrize("toolkit", TOOLKITS)
def test_every_toolkit_name_resolves(toolkit):
    module = importlib.import_module(toolkit)
    assert module.__all__, toolkit
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{toolkit}.{name}"


def test_builtin_entry_points_name_public_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for group, entries in project["entry-points"].items():
        if not group.startswith("wtransfer."):
            continue
        for name, value in entries.items():
            module = value.split(":")[0]
            assert module in PUBLIC_MODULES, f"{group} {name} = {value}: a built-in must live in a public module"


def test_trainer_extension_points_are_public():
    """A new engine's trainer side overrides only public names (no `_prepare`, `_send_round`...)."""
    from wtransfer.engines import TrainerWeightTransferEngine

    abstract = TrainerWeightTransferEngine.__abstractmethods__
    assert abstract == {"prepare_workers", "wait_for_workers", "send_round", "release"}
    assert not [name for name in abstract if name.startswith("_")]


def test_tests_never_import_the_bench():
    """Benchmarks sit on top; tests reach them only through the CLI, and models come from wtransfer.testing."""
    offenders = {
        str(path.relative_to(ROOT)): [m for m in wtransfer_imports(path.read_text()) if m.startswith("wtransfer._bench")]
        for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "plugins").rglob("tests/**/*.py")]
        if "build" not in path.parts
    }
    assert {path: names for path, names in offenders.items() if names} == {}
