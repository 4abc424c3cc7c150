"""The plugin author's surface: what plugins may import, enforced on the plugins we ship.

``PUBLIC_MODULES`` is the promise (the plugin guide, docs/plugins.md, lists the same). Everything else
is private: ``_``-modules, and the folders inside ``wtransfer/engines/``. The checks read the import statements of ``plugins/`` and of the
example plugin, as a third party's code would be read, and can fail: the first test feeds
the checker imports of private modules and requires it to flag each one.
"""

from __future__ import annotations

import ast
import re
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
    "wtransfer.engines.wire",
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
    "wtransfer.testing.bench_blocks",
    "wtransfer.testing.conformance",
    "wtransfer.testing.distributions",
    "wtransfer.testing.leaks",
    "wtransfer.testing.models",
    "wtransfer.testing.paged_engine",
    "wtransfer.testing.processes",
}
TOOLKITS = ("wtransfer", "wtransfer.engines", "wtransfer.engines.wire", "wtransfer.connectors", "wtransfer.specs")

# Each toolkit's exact promise: adding a name here is a decision, not a side effect of an import.
TOOLKIT_NAMES: dict[str, set[str]] = {
    # upper layer: deriving from a built-in, or writing a worker/trainer pair
    "wtransfer.engines": {
        "BufferBudgetOptions", "ClientCall", "LoadWeights", "ManifestUpdateInfo", "ModuleSource",
        "SharedMemoryInitOptions", "SharedMemoryTrainer", "SharedMemoryWeightTransferEngine", "StreamSource", "TensorSource",
        "TorchDistributedBackend", "TorchDistributedInitInfo", "TorchDistributedInitOptions",
        "TorchDistributedOptions", "TorchDistributedSender", "TorchDistributedTrainer",
        "TorchDistributedWeightTransferEngine", "TrainerInitOptions", "TrainerWeightTransferEngine", "WeightSource", "WeightTransferEngine",
        "WeightTransferInitInfo", "WeightTransferUpdateInfo", "accepts_weight_version", "check_buffer_budget",
        "create_trainer",
        "global_rank", "module_loader",
    },
    # lower layer: writing a brand-new transport
    "wtransfer.engines.wire": {
        "ALIGN", "Bucket", "ControlChannel", "Listener", "MIB", "Manifest", "ManifestRejected",
        "PROTOCOL_VERSION", "Packer", "PeerClosedError", "TensorEntry", "Unpacker", "build_manifest",
        "check_bucket_bytes", "check_int", "check_protocol", "check_timeout", "connect", "gc_paused",
        "plan_buckets", "tensor_checksum",
    },
    "wtransfer.connectors": {
        "KVCacheSpec", "KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
        "KVRequest", "KV_LAYOUTS", "ScheduledRequest", "SchedulerStep", "block_hashes", "block_view",
        "full_block_range", "kv_namespace",
    },
    "wtransfer.specs": {
        "ARCPolicy", "BlockCopyHandler", "BlockTableManager", "CPU_MEDIUM", "DEVICE_MEDIUM", "EvictionPolicy",
        "KVCacheSpec", "LRUPolicy", "LoadStoreSpec", "OffloadingEvent", "OffloadingHandler",
        "OffloadingManager", "OffloadingSpec", "OffloadingSpecOptions", "PrepareStoreOutput",
        "TransferResult", "block_view", "create_policy",
    },
}
# Engine plugins (the NCCL plugin, the example plugin) are built from the two engine layers alone
# (plus wtransfer's errors and typed options, which every kind shares).
ENGINE_PLUGIN_MODULES = {"wtransfer", "wtransfer.options", "wtransfer.engines", "wtransfer.engines.wire"}
ENGINE_PLUGINS = ("plugins/wtransfer-nccl/wtransfer_nccl/engine.py", "tests/example_plugin/wtransfer_example/engine.py")



def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of wtransfer's source tree (not a name defined in one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def wtransfer_imports(source: str) -> list[str]:
    """Every ``wtransfer`` module a source file imports (statements and ``import_module`` strings)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            # `from wtransfer.engines import rounds` names a module too
            found += [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
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
from wtransfer.engines.trainer.engine import MIB
from wtransfer.engines import channel
from wtransfer.cli import main
import importlib; importlib.import_module("wtransfer.connectors._base")
'''
    assert private_imports(broken) == [
        "wtransfer._registry.registry", "wtransfer.engines.trainer.engine", "wtransfer.engines.channel",
        "wtransfer.cli", "wtransfer.connectors._base",
    ]
    assert private_imports("import wtransfer\nfrom wtransfer.engines.wire import MIB\n"
                           "from wtransfer.engines import SharedMemoryTrainer\n") == []


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


@pytest.mark.parametrize("toolkit", sorted(TOOLKIT_NAMES))
def test_each_toolkit_exports_exactly_its_promise(toolkit):
    assert set(importlib.import_module(toolkit).__all__) == TOOLKIT_NAMES[toolkit]


def test_the_engine_layers_do_not_overlap_and_the_upper_one_stays_small():
    """Catches: a name exported by both layers (two homes) or the upper layer growing unnoticed."""
    upper = set(importlib.import_module("wtransfer.engines").__all__)
    lower = set(importlib.import_module("wtransfer.engines.wire").__all__)
    assert not upper & lower
    # 28: TorchDistributedSender joined so that a collective backend's sharded trainers (NCCL's)
    # send from every rank; the next name in needs one out
    assert len(upper) <= 28, "the upper layer is what every engine author must learn: keep it near 20 names"


def imported_names(source: str) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from wtransfer... import name`` in ``source``."""
    return [(node.module, alias.name) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wtransfer")
            for alias in node.names]


def test_the_name_checker_reads_real_imports():
    assert imported_names("from wtransfer.engines import MIB, ModuleSource\nimport wtransfer\n") == [
        ("wtransfer.engines", "MIB"), ("wtransfer.engines", "ModuleSource")]


@pytest.mark.parametrize("path", ENGINE_PLUGINS)
def test_engine_plugins_are_built_from_the_two_layers(path):
    """Catches: an engine plugin importing another module, or a name its toolkit does not export
    (``from wtransfer.engines import MIB`` would only work through the moved-name error)."""
    source = (ROOT / path).read_text()
    imported = set(wtransfer_imports(source))
    assert {"wtransfer.engines", "wtransfer.engines.wire"} & imported, path  # the test reads real imports
    assert imported <= ENGINE_PLUGIN_MODULES, f"{path} imports {sorted(imported - ENGINE_PLUGIN_MODULES)}"
    for module, name in imported_names(source):
        assert name in importlib.import_module(module).__all__, f"{path}: {name} is not in {module}.__all__"


PLUGIN_GUIDE = ROOT / "docs" / "plugins.md"
TOOLKIT_ROW = re.compile(r"^\| `(wtransfer(?:\.[a-z]+)*)` \|(.*)\|$", re.MULTILINE)


@pytest.mark.parametrize("toolkit", sorted(TOOLKIT_NAMES))
def test_the_plugin_guide_lists_exactly_what_each_toolkit_exports(toolkit):
    """Catches: the plugin guide's table promising a name the toolkit does not export, or missing one."""
    rows = {module: text for module, text in TOOLKIT_ROW.findall(PLUGIN_GUIDE.read_text())}
    assert toolkit in rows, f"docs/plugins.md's module table has no row for {toolkit}"
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", rows[toolkit]))
    assert listed == TOOLKIT_NAMES[toolkit], (sorted(listed - TOOLKIT_NAMES[toolkit]),
                                              sorted(TOOLKIT_NAMES[toolkit] - listed))


def test_type_checkers_see_every_lazy_export_of_the_top_level():
    """Catches: a name added to ``_EXPORTS`` but not to the ``TYPE_CHECKING`` imports type checkers read (IDEs then
    mark ``wtransfer.<name>`` unknown), or one imported from a module other than where it lives."""
    import ast

    import wtransfer

    tree = ast.parse((ROOT / "wtransfer" / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    seen: dict[str, set[str]] = {}
    for node in block.body:
        seen.setdefault(node.module, set()).update(alias.name for alias in node.names)
    assert seen == {module: set(names) for module, names in wtransfer._EXPORTS.items()}


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]
DOC_IMPORT = re.compile(r"^\s*from (wtransfer(?:\.[a-z_]+)*) import \(?([A-Za-z_][A-Za-z0-9_, ]*)\)?", re.M)


def doc_imports(text: str) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from wtransfer... import name`` a page shows, in any code block."""
    return [(module, name.strip()) for module, names in DOC_IMPORT.findall(text) for name in names.split(",")
            if name.strip()]


def test_the_doc_import_reader_reads_what_a_page_shows():
    page = "```py\nfrom wtransfer.engines import (ModuleSource, create_trainer)\n```\n  from wtransfer import X\n"
    assert doc_imports(page) == [("wtransfer.engines", "ModuleSource"), ("wtransfer.engines", "create_trainer"),
                                 ("wtransfer", "X")]


def test_every_import_the_docs_show_is_public_and_resolves():
    """What a reader copies from a page works, whatever the fence (vLLM outlines are not run), and comes from a
    public module: moving code behind the toolkits must not break a documented import."""
    shown = {(page.relative_to(ROOT), module, name) for page in DOC_PAGES for module, name in doc_imports(page.read_text())}
    assert len(shown) >= 20
    private = sorted(f"{page}: from {module} import {name}" for page, module, name in shown if module not in PUBLIC_MODULES)
    assert not private, private
    broken = []
    for page, module, name in sorted(shown):
        if not hasattr(importlib.import_module(module), name):
            broken.append(f"{page}: from {module} import {name}")
    assert not broken, broken
