"""Plugin core: discovery, laziness, conflicts, errors, hooks — against real distributions."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

import wtransfer
from wtransfer import (
    KVConnectorFactory,
    KVTransferConfig,
    OffloadingSpecFactory,
    WeightTransferConfig,
    WeightTransferEngineFactory,
)
from wtransfer._registry.registry import registry_for
from demo_engine import demo_engine_module
from wtransfer.testing.distributions import site_on_path, write_distribution
from wtransfer.testing.processes import run_python


def engine_module(cls: str = "DemoEngine", marker: str | None = None) -> str:
    """Source of a module defining a concrete engine; ``marker`` is a file it appends to on import."""
    prefix = f"open({marker!r}, 'a').write('imported\\n')" if marker else ""
    return demo_engine_module(cls, prefix)


@pytest.fixture
def site(tmp_path: Path):
    """A fresh site directory on sys.path; modules imported from it are forgotten afterwards."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    with site_on_path(site_dir):
        yield site_dir


def add_dist(site_dir: Path, name: str, group: str, entries: dict[str, str], modules=None, version="1.0"):
    write_distribution(site_dir, name, version, {group: entries}, modules or {})
    importlib.invalidate_caches()
    wtransfer.refresh()


# -- import cost and laziness -----------------------------------------------------------------


def test_import_wtransfer_loads_no_heavy_module():
    out = run_python(
        """
        import sys, wtransfer
        wtransfer.WeightTransferConfig, wtransfer.KVTransferConfig, wtransfer.WTransferError
        heavy = [m for m in ("torch", "pluggy", "importlib.metadata", "importlib_metadata") if m in sys.modules]
        print(heavy)
        """
    )
    assert out.stdout.strip() == "[]"


def test_builtins_are_declared_as_entry_points():
    infos = {(i.kind, i.name): i for i in wtransfer.list_components()}
    for key in [("engines", "shm"), ("engines", "gloo"), ("connectors", "storage"), ("connectors", "multi"),
                ("connectors", "offloading"), ("specs", "cpu")]:
        assert key in infos, key
        assert infos[key].distribution == "wtransfer"
        assert infos[key].status in ("available", "loaded")


def test_listing_reads_metadata_only(tmp_path: Path):
    site_dir = tmp_path / "site"
    marker = tmp_path / "imported.txt"
    write_distribution(site_dir, "acme-lazy", "3.1", {"wtransfer.engines": {"lazy": "acme_lazy.engine:DemoEngine"}},
                       {"acme_lazy.engine": engine_module(marker=str(marker))})
    out = run_python(
        """
        import json, sys, wtransfer
        infos = [i.to_dict() for i in wtransfer.list_components()]
        plugin_modules = [m for m in sys.modules if m.startswith(("acme_lazy", "wtransfer.engines.", "wtransfer.connectors.", "wtransfer.specs."))]
        print(json.dumps({"infos": infos, "plugin_modules": plugin_modules}))
        """,
        path=[site_dir],
    )
    data = json.loads(out.stdout)
    assert not marker.exists()
    assert data["plugin_modules"] == []
    lazy = [i for i in data["infos"] if i["name"] == "lazy"]
    assert lazy == [{"kind": "engines", "name": "lazy", "distribution": "acme-lazy", "version": "3.1",
                     "target": "acme_lazy.engine:DemoEngine", "status": "available"}]

    cli = run_python("from wtransfer.cli import main; raise SystemExit(main(['list', '--json']))", path=[site_dir])
    rows = json.loads(cli.stdout)
    assert all(set(row) == {"kind", "name", "distribution", "version", "target", "status"} for row in rows)
    assert any(row["name"] == "lazy" for row in rows)
    assert not marker.exists(), "wtransfer list imported a plugin module"


def test_class_imported_once_on_first_use(site: Path, tmp_path: Path):
    marker = tmp_path / "imports.txt"
    add_dist(site, "acme-once", "wtransfer.engines", {"once": "acme_once.engine:DemoEngine"},
             {"acme_once.engine": engine_module(marker=str(marker))})
    assert not marker.exists()
    first = wtransfer.get_class("engines", "once")
    assert marker.read_text() == "imported\n"
    assert wtransfer.get_class("engine", "once") is first
    assert wtransfer.get_class("engines", "acme-once:once") is first
    WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="once"))
    assert marker.read_text() == "imported\n"
    status = {i.name: i.status for i in wtransfer.list_components("engines")}
    assert status["once"] == "loaded"


def test_scanned_once_until_refresh(site: Path):
    add_dist(site, "acme-first", "wtransfer.engines", {"first": "acme_first.engine:DemoEngine"},
             {"acme_first.engine": engine_module()})
    assert "first" in registry_for("engines").names()
    # A distribution installed after the scan stays invisible to later lookups...
    write_distribution(site, "acme-late", "1.0", {"wtransfer.engines": {"late": "acme_late.engine:DemoEngine"}},
                       {"acme_late.engine": engine_module()})
    importlib.invalidate_caches()
    for _ in range(1000):
        assert "late" not in registry_for("engines").names()
    # ... until refresh() rescans, as after a `pip install` in a live process.
    wtransfer.refresh()
    assert wtransfer.get_class("engines", "late").__name__ == "DemoEngine"


CHILD_MODULE = """
from wtransfer import get_class
from wtransfer._registry.registry import registry_for

def child(path):
    cls = get_class("engines", "child")
    runtime = "runtime-only" in registry_for("engines").names()
    with open(path, "w") as f:
        f.write(f"{cls.__name__} {runtime}")
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_children_see_installed_components_without_registration(tmp_path: Path, method: str):
    site_dir = tmp_path / "site"
    write_distribution(site_dir, "acme-child", "1.0", {"wtransfer.engines": {"child": "acme_child.engine:DemoEngine"}},
                       {"acme_child.engine": engine_module(), "childmod": CHILD_MODULE})
    result = tmp_path / "out.txt"
    out = run_python(
        f"""
        import multiprocessing as mp
        import childmod
        from wtransfer import WeightTransferEngineFactory
        if __name__ == "__main__":
            WeightTransferEngineFactory.register_engine("runtime-only", "acme_child.engine", "DemoEngine")
            p = mp.get_context({method!r}).Process(target=childmod.child, args=({str(result)!r},))
            p.start()
            p.join(60)
            print(p.exitcode)
        """,
        path=[site_dir],
    )
    assert out.stdout.strip() == "0"
    name, runtime_seen = result.read_text().split()
    assert name == "DemoEngine"
    # Runtime registrations belong to the process that made them: a spawned child does not
    # see them (a forked child inherits the parent's memory, so it does).
    assert runtime_seen == ("True" if method == "fork" else "False")


# -- broken plugins, conflicts, disabling ------------------------------------------------------


def test_broken_plugin_is_reported_and_isolated(site: Path):
    add_dist(site, "acme-broken", "wtransfer.engines", {"broken": "acme_broken.engine:Engine"},
             {"acme_broken.engine": "raise RuntimeError('boom at import')\n"}, version="0.3")
    with pytest.raises(wtransfer.ComponentLoadError) as info:
        wtransfer.get_class("engines", "broken")
    message = str(info.value)
    for fragment in ("acme-broken", "0.3", "broken", "acme_broken.engine:Engine", "boom at import"):
        assert fragment in message
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, RuntimeError)
    # The same error again (no second import attempt), and everything else still works.
    with pytest.raises(wtransfer.ComponentLoadError):
        wtransfer.get_class("engines", "broken")
    assert wtransfer.get_class("specs", "cpu") if _has_module("wtransfer.specs.cpu") else True
    assert wtransfer.get_class("engines", "shm") if _has_module("wtransfer.engines.shm") else True


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_non_subclass_is_rejected(site: Path):
    add_dist(site, "acme-wrong", "wtransfer.connectors", {"wrong": "acme_wrong.mod:NotAConnector"},
             {"acme_wrong.mod": "class NotAConnector:\n    pass\n"})
    with pytest.raises(wtransfer.InvalidComponentError, match="not a subclass of .*KVConnectorBase") as info:
        wtransfer.get_class("connectors", "wrong")
    assert isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match="not a subclass"):
        WeightTransferEngineFactory.register_engine("wrong-class", dict)


def test_conflicting_names_are_never_resolved_silently(site: Path, monkeypatch: pytest.MonkeyPatch):
    write_distribution(site, "acme-a", "1.0", {"wtransfer.engines": {"twin": "acme_a.engine:DemoEngine"}},
                       {"acme_a.engine": engine_module()})
    add_dist(site, "Acme_B", "wtransfer.engines", {"twin": "acme_b.engine:DemoEngine"},
             {"acme_b.engine": engine_module()}, version="2.0")
    with pytest.raises(wtransfer.AmbiguousComponentError) as info:
        wtransfer.get_class("engines", "twin")
    message = str(info.value)
    for fragment in ("'acme-a:twin'", "'acme-b:twin'", "acme-a 1.0", "Acme_B 2.0"):
        assert fragment in message
    assert isinstance(info.value, ValueError)
    a = wtransfer.get_class("engines", "acme-a:twin")
    b = wtransfer.get_class("engines", "ACME_b:twin")  # qualified names are normalised like pip does
    assert a.__module__ == "acme_a.engine" and b.__module__ == "acme_b.engine"
    statuses = {i.distribution: i.status for i in wtransfer.list_components("engines") if i.name == "twin"}
    assert statuses == {"acme-a": "conflict", "Acme_B": "conflict"}
    # Disabling one provider makes the bare name unambiguous again.
    monkeypatch.setenv("WTRANSFER_DISABLE_PLUGINS", "acme-b")
    wtransfer.refresh()
    assert wtransfer.get_class("engines", "twin") is a
    statuses = {i.distribution: i.status for i in wtransfer.list_components("engines") if i.name == "twin"}
    assert statuses == {"acme-a": "loaded", "Acme_B": "disabled"}


def test_disabled_components_are_not_loaded(site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    marker = tmp_path / "imported.txt"
    add_dist(site, "acme-off", "wtransfer.engines", {"off": "acme_off.engine:DemoEngine"},
             {"acme_off.engine": engine_module(marker=str(marker))})
    for value in ("acme_off", "engines:off", "engine:off, something-else"):
        monkeypatch.setenv("WTRANSFER_DISABLE_PLUGINS", value)
        wtransfer.refresh()
        with pytest.raises(wtransfer.DisabledComponentError, match="WTRANSFER_DISABLE_PLUGINS"):
            WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="off"))
        status = {i.name: i.status for i in wtransfer.list_components("engines")}
        assert status["off"] == "disabled"
    assert not marker.exists()


def test_unknown_names_suggest_and_hint():
    with pytest.raises(wtransfer.UnknownComponentError) as info:
        wtransfer.get_class("engines", "shn")
    assert "Did you mean 'shm'?" in str(info.value)
    assert "Available engines:" in str(info.value) and "gloo" in str(info.value)
    assert isinstance(info.value, ValueError)
    if "nccl" not in registry_for("engines").names():
        with pytest.raises(wtransfer.UnknownComponentError, match="wtransfer-nccl") as info:
            WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="nccl"))
        assert "pip install" in str(info.value)
    with pytest.raises(ValueError, match="Unknown component kind"):
        wtransfer.list_components("engins")


# -- runtime registration and module-path fallbacks -----------------------------------------------


def test_runtime_registration(site: Path):
    add_dist(site, "acme-rt", "wtransfer.engines", {"rt-held": "acme_rt.engine:DemoEngine"},
             {"acme_rt.engine": engine_module()})
    registry = registry_for("engines")
    try:
        with pytest.raises(ValueError, match="class_name is required"):
            WeightTransferEngineFactory.register_engine("rt-lazy", "acme_rt.engine")
        WeightTransferEngineFactory.register_engine("rt-lazy", "acme_rt.engine", "DemoEngine")
        with pytest.raises(wtransfer.DuplicateComponentError, match="already registered.*runtime"):
            WeightTransferEngineFactory.register_engine("rt-lazy", "acme_rt.engine", "DemoEngine")
        with pytest.raises(ValueError, match="already registered.*acme-rt"):
            WeightTransferEngineFactory.register_engine("rt-held", "acme_rt.engine", "DemoEngine")
        with pytest.raises(ValueError, match="already registered.*'wtransfer'"):
            WeightTransferEngineFactory.register_engine("shm", "acme_rt.engine", "DemoEngine")
        engine_cls = wtransfer.get_class("engines", "rt-held")
        WeightTransferEngineFactory.register_engine("rt-direct", engine_cls)
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="rt-direct"))
        assert type(engine) is engine_cls and engine.parallel_config.world_size == 1
        assert wtransfer.get_class("engines", "rt-lazy").__name__ == "DemoEngine"
        listed = {i.name: i for i in wtransfer.list_components("engines")}
        assert listed["rt-lazy"].distribution is None and listed["rt-direct"].status == "loaded"
        # Runtime registrations survive a rescan: they belong to this process.
        wtransfer.refresh()
        assert "rt-lazy" in registry.names()
    finally:
        for name in ("rt-lazy", "rt-direct"):
            registry.unregister(name)


CONNECTOR_SOURCE = '''
from wtransfer.connectors._base import KVConnectorBase
from wtransfer.specs._base import OffloadingSpec

def _concrete(base):
    """Fill in whatever abstract methods the base declares, so the test only checks loading."""
    names = {n: (lambda self, *a, **k: None) for n in getattr(base, "__abstractmethods__", ())}
    return names

class PathConnector(KVConnectorBase):
    locals().update(_concrete(KVConnectorBase))

class PathSpec(OffloadingSpec):
    locals().update(_concrete(OffloadingSpec))
'''


def test_module_path_fallbacks_for_all_three_kinds(site: Path):
    add_dist(site, "acme-paths", "wtransfer.engines", {}, {
        "acme_paths.engines": engine_module("PathEngine"),
        "acme_paths.kv": CONNECTOR_SOURCE,
    })
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="PathEngine", module_path="acme_paths.engines"))
    assert type(engine).__name__ == "PathEngine"
    from wtransfer.connectors._base import KVConnectorRole

    config = KVTransferConfig(kv_connector="PathConnector", kv_connector_module_path="acme_paths.kv")
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
    assert type(connector).__name__ == "PathConnector" and connector.role is KVConnectorRole.WORKER
    spec_config = KVTransferConfig(
        kv_connector="offloading",
        kv_connector_extra_config={"spec_name": "PathSpec", "spec_module_path": "acme_paths.kv"})
    assert type(OffloadingSpecFactory.create_spec(spec_config, None)).__name__ == "PathSpec"
    # A module path that does not hold the class is a clear load error.
    with pytest.raises(wtransfer.ComponentLoadError, match="NoSuchEngine.*acme_paths.engines"):
        WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="NoSuchEngine", module_path="acme_paths.engines"))


# -- hooks ------------------------------------------------------------------------------------------

HOOKS_SOURCE = '''
import wtransfer
from wtransfer._registry.component import ComponentRef

SEEN = []

@wtransfer.hookimpl
def wtransfer_engine_created(engine):
    SEEN.append(type(engine).__name__)

@wtransfer.hookimpl
def wtransfer_components(kind):
    if kind == "engines":
        return [ComponentRef("engines", "from-hook", "acme_hooks.engine:DemoEngine", "acme-hooks", "1.0", origin="hook")]
    return []
'''


def test_hook_plugins_observe_and_contribute(site: Path):
    write_distribution(site, "acme-broken-hooks", "1.0", {"wtransfer.plugins": {"bad": "acme_bad_hooks"}},
                       {"acme_bad_hooks": "raise ImportError('missing dependency')\n"})
    add_dist(site, "acme-hooks", "wtransfer.plugins", {"acme": "acme_hooks.hooks"},
             {"acme_hooks.hooks": HOOKS_SOURCE, "acme_hooks.engine": engine_module()})
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="from-hook"))
    hooks = sys.modules["acme_hooks.hooks"]
    assert hooks.SEEN == [type(engine).__name__]
    from wtransfer._registry.manager import hook_plugins

    statuses = {p.record.distribution: (p.status, p.error) for p in hook_plugins()}
    assert statuses["acme-hooks"] == ("loaded", None)
    assert statuses["acme-broken-hooks"][0] == "broken" and "missing dependency" in statuses["acme-broken-hooks"][1]


RAISING_HOOKS = """
import wtransfer

@wtransfer.hookimpl
def wtransfer_components(kind):
    raise FileNotFoundError("/etc/acme/registry.yaml")  # a config file this host lacks
"""

FAILING_OBSERVER = """
import wtransfer

CALLS = []

@wtransfer.hookimpl
def wtransfer_engine_created(engine):
    CALLS.append(type(engine).__name__)
    raise RuntimeError("metrics endpoint down")
"""

RECORDING_OBSERVER = """
import wtransfer

SEEN = []

@wtransfer.hookimpl
def wtransfer_engine_created(engine):
    SEEN.append(type(engine).__name__)
"""

WRAPPING_HOOKS = """
import wtransfer

@wtransfer.hookimpl(wrapper=True)
def wtransfer_components(kind):
    found = yield
    return [[ref for ref in contributed if ref.name != "shm"] for contributed in found]
"""


def test_a_hook_that_raises_when_called_stops_neither_the_other_plugins_nor_the_builtins(
        site: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]):
    """Before, pluggy's one call of ``wtransfer_components`` raised the first plugin's error to every lookup: one
    plugin missing a config file made ``shm`` itself, every other plugin's components and ``wtransfer list`` fail
    (inside vLLM, every wtransfer component went missing). And one observer that raised kept the others from
    hearing the event. Now each plugin is called on its own: a contributor that raises is blocked and reported
    broken, naming its distribution; an observer that raises is logged and called again next time."""
    # the failing plugins sit later on sys.path than the others: registered after them, pluggy calls them first
    write_distribution(site, "acme-raising", "1.0", {"wtransfer.plugins": {"raising": "acme_raising_hooks"}},
                       {"acme_raising_hooks": RAISING_HOOKS})
    write_distribution(site, "acme-noisy", "1.0", {"wtransfer.plugins": {"noisy": "acme_noisy_hooks"}},
                       {"acme_noisy_hooks": FAILING_OBSERVER})
    write_distribution(site, "acme-wrapping", "1.0", {"wtransfer.plugins": {"wrapping": "acme_wrapping_hooks"}},
                       {"acme_wrapping_hooks": WRAPPING_HOOKS})
    first = site.parent / "site-first"
    first.mkdir()
    write_distribution(first, "acme-quiet", "1.0", {"wtransfer.plugins": {"quiet": "acme_quiet_hooks"}},
                       {"acme_quiet_hooks": RECORDING_OBSERVER})
    write_distribution(first, "acme-hooks", "1.0", {"wtransfer.plugins": {"acme": "acme_hooks.hooks"}},
                       {"acme_hooks.hooks": HOOKS_SOURCE, "acme_hooks.engine": engine_module()})
    with site_on_path(first):
        from wtransfer._registry.manager import hook_plugins, plugin_manager

        called = [impl.plugin_name for impl in reversed(
            plugin_manager().hook.wtransfer_engine_created.get_hookimpls())]
        assert called.index("noisy") < min(called.index("quiet"), called.index("acme")), called  # noisy first
        with caplog.at_level("WARNING", logger="wtransfer"):
            names = {i.name for i in wtransfer.list_components("engines")}
        assert {"shm", "gloo", "from-hook"} <= names  # the built-ins and the other plugin's contribution
        assert "acme-raising" in caplog.text and "/etc/acme/registry.yaml" in caplog.text
        assert "WTRANSFER_DISABLE_PLUGINS=acme-raising" in caplog.text
        statuses = {p.record.distribution: (p.status, p.error) for p in hook_plugins()}
        assert statuses["acme-raising"] == (
            "broken", "its wtransfer_components(kind='engines') raised FileNotFoundError: /etc/acme/registry.yaml")
        assert plugin_manager().is_blocked("raising")
        # a wrapper, called on its own, would wrap nothing (its filter silently off): refused when loaded
        assert statuses["acme-wrapping"][0] == "broken" and "as a hook wrapper" in statuses["acme-wrapping"][1]
        assert {"storage", "multi"} <= {i.name for i in wtransfer.list_components("connectors")}  # other kinds too
        for _ in range(2):
            WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="from-hook"))
        noisy, quiet = sys.modules["acme_noisy_hooks"], sys.modules["acme_quiet_hooks"]
        assert noisy.CALLS == quiet.SEEN == ["DemoEngine", "DemoEngine"]  # heard twice, each
        assert sys.modules["acme_hooks.hooks"].SEEN == ["DemoEngine", "DemoEngine"]
        assert dict((p.record.distribution, p.status) for p in hook_plugins())["acme-noisy"] == "loaded"

        wtransfer.refresh()  # a fresh process's view: `wtransfer list plugins` alone calls the contributors too
        from wtransfer.cli import main

        capsys.readouterr()
        assert main(["list", "plugins", "--json"]) == 0
        rows = {row["distribution"]: row for row in json.loads(capsys.readouterr().out)}
        assert rows["acme-raising"]["status"] == "broken" and "registry.yaml" in rows["acme-raising"]["problem"]
        assert rows["acme-hooks"]["status"] == "loaded"


def test_a_misspelled_hook_is_an_error_naming_plugin_and_hook(site: Path):
    # Without the check, pluggy registers the typo as a hook nobody calls: silence.
    write_distribution(site, "acme-typo-hooks", "1.0", {"wtransfer.plugins": {"typo": "acme_typo_hooks"}},
                       {"acme_typo_hooks": "import wtransfer\n"
                                           "@wtransfer.hookimpl\n"
                                           "def wtransfer_update_finishd(stats):\n    pass\n"})
    from wtransfer._registry.manager import hook_plugins, plugin_manager

    statuses = {p.record.distribution: (p.status, p.error) for p in hook_plugins()}
    status, error = statuses["acme-typo-hooks"]
    assert status == "broken"
    assert "wtransfer_update_finishd" in error and "Did you mean 'wtransfer_update_finished'" in error
    assert plugin_manager().get_plugin("typo") is None and plugin_manager().is_blocked("typo")
    plugin_manager().check_pending()  # nothing unverified is left behind


OBSERVER = "import wtransfer\n@wtransfer.hookimpl\ndef wtransfer_update_finished(stats):\n    pass\n"


def test_hook_plugins_are_loaded_and_blocked_the_pluggy_way(site: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    """Catches: a disabled or broken hook plugin left registered (its hooks would still run), one
    broken plugin stopping the others, and a name two distributions declare going to whichever
    comes first on sys.path (a silent winner)."""
    marker = tmp_path / "imported.txt"
    write_distribution(site, "acme-off", "1.0", {"wtransfer.plugins": {"off": "acme_off_hooks"}},
                       {"acme_off_hooks": f"open({str(marker)!r}, 'a').write('x')\n" + OBSERVER})
    write_distribution(site, "acme-one", "1.0", {"wtransfer.plugins": {"twin": "acme_one_hooks"}},
                       {"acme_one_hooks": OBSERVER})
    write_distribution(site, "acme-two", "1.0", {"wtransfer.plugins": {"twin": "acme_two_hooks"}},
                       {"acme_two_hooks": OBSERVER})
    write_distribution(site, "acme-raises", "1.0", {"wtransfer.plugins": {"raises": "acme_raises_hooks"}},
                       {"acme_raises_hooks": "raise RuntimeError('no GPU here')\n"})
    write_distribution(site, "acme-taken", "1.0", {"wtransfer.plugins": {"wtransfer.entry-points": "acme_taken"}},
                       {"acme_taken": OBSERVER})  # a name pluggy already holds (the built-in contributor's)
    add_dist(site, "acme-fine", "wtransfer.plugins", {"fine": "acme_fine_hooks"}, {"acme_fine_hooks": OBSERVER})
    monkeypatch.setenv("WTRANSFER_DISABLE_PLUGINS", "acme-off")
    wtransfer.refresh()
    from wtransfer._registry.manager import hook_plugins, plugin_manager

    statuses = {p.record.distribution: (p.status, p.error) for p in hook_plugins()}
    pm = plugin_manager()
    assert statuses["acme-off"] == ("disabled", None) and pm.is_blocked("off") and not marker.exists()
    for twin in ("acme-one", "acme-two"):
        status, error = statuses[twin]
        assert status == "broken" and "acme-one, acme-two each declare hook plugin 'twin'" in error, error
    assert pm.is_blocked("twin") and "acme_one_hooks" not in sys.modules and "acme_two_hooks" not in sys.modules
    assert statuses["acme-raises"][0] == "broken" and "no GPU here" in statuses["acme-raises"][1]
    assert pm.is_blocked("raises")
    assert statuses["acme-taken"][0] == "broken" and "is wtransfer's own" in statuses["acme-taken"][1]
    assert "shm" in {i.name for i in wtransfer.list_components("engines")}  # the built-in contributor stays
    assert statuses["acme-fine"] == ("loaded", None)
    assert pm.get_plugin("fine") is sys.modules["acme_fine_hooks"]
    assert [d.project_name for _, d in pm.list_plugin_distinfo()] == ["acme-fine"]  # pluggy's own record

    # Disabling one twin does not pick the other: pluggy's loader, keyed by name, could import either.
    monkeypatch.setenv("WTRANSFER_DISABLE_PLUGINS", "acme-two")
    wtransfer.refresh()
    statuses = {p.record.distribution: p.status for p in hook_plugins()}
    assert statuses["acme-one"] == "broken" and statuses["acme-two"] == "disabled"
    assert "acme_one_hooks" not in sys.modules and "acme_two_hooks" not in sys.modules


def test_a_mistyped_disable_entry_is_a_warning_not_silence(site: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture):
    """Before, an unknown kind made the entry a distribution name, and an unknown component or distribution name
    was kept as given: each blocked nothing, and nothing said so."""
    monkeypatch.setenv("WTRANSFER_DISABLE_PLUGINS", "engins:shm, engines:shmm, acme-nope, engines:gloo")
    wtransfer.refresh()
    with caplog.at_level("WARNING", logger="wtransfer"):
        statuses = {i.name: i.status for i in wtransfer.list_components("engines")}
    assert statuses["shm"] in ("available", "loaded") and statuses["gloo"] == "disabled"
    assert "WTRANSFER_DISABLE_PLUGINS: 'engins:shm' blocks nothing: Unknown component kind 'engins'" in caplog.text
    assert "'engines:shmm' blocks nothing" in caplog.text and "did you mean engines:shm?" in caplog.text
    assert "'acme-nope' blocks nothing" in caplog.text
    assert "'engines:gloo' blocks nothing" not in caplog.text  # what it does block is not warned about


def test_trace_logs_hook_calls(tmp_path: Path):
    out = run_python(
        """
        import logging, wtransfer
        logging.basicConfig(level=logging.INFO)
        wtransfer.list_components("engines")
        """,
        env={"WTRANSFER_TRACE": "1"},
    )
    assert "wtransfer_components" in out.stderr


# -- a real pip-installed plugin, discovered in fresh interpreters ----------------------------------

def test_pip_installed_plugin_is_discovered_everywhere(installed_example: Path, tmp_path: Path):
    log = tmp_path / "hooks.log"
    out = run_python(
        """
        import json, wtransfer
        from wtransfer import WeightTransferConfig, WeightTransferEngineFactory
        listed = [i.to_dict() for i in wtransfer.list_components("engine") if i.name == "example"]
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="wtransfer-example:example"))
        print(json.dumps({"listed": listed, "trainer": engine.trainer_cls.__name__}))
        engine.shutdown()
        """,
        path=[installed_example], env={"WTRANSFER_EXAMPLE_LOG": str(log)},
    )
    data = json.loads(out.stdout)
    assert data["listed"] == [{"kind": "engines", "name": "example", "distribution": "wtransfer-example",
                               "version": "0.2.0", "target": "wtransfer_example.engine:ExampleEngine",
                               "status": "available"}]
    assert data["trainer"] == "SmallModelTrainer"
    assert log.read_text() == "created ExampleEngine\n"


def test_cli_show_and_check(installed_example: Path):
    shown = run_python("from wtransfer.cli import main; raise SystemExit(main(['show', 'engine', 'example']))",
                       path=[installed_example])
    # the user's options with the plugin's own trainer defaults (4 MiB x 3), never wire fields
    for fragment in ("ExampleEngine", "wtransfer-example 0.2.0", "max_buffer_bytes", "SmallModelTrainer",
                     r"bucket_bytes +int +4194304 ", r"num_buffers +int +3 ", r"timeout_s +float +300\.0 ",
                     "Example engine shipped"):
        assert re.search(fragment, shown.stdout), fragment
    assert "token" not in shown.stdout and "is_checkpoint_format" not in shown.stdout
    checked = run_python("from wtransfer.cli import main; raise SystemExit(main(['check', '--json']))",
                         path=[installed_example], check=False)
    rows = json.loads(checked.stdout)
    example = [r for r in rows if r["name"] == "example"]
    assert {r["kind"]: r["status"] for r in example} == {"engines": "ok", "hook plugin": "ok"}
    broken = [r for r in rows if r["status"] in ("broken", "conflict")]
    assert checked.returncode == (1 if broken else 0), broken


def test_cli_check_fails_on_broken_and_passes_when_disabled(tmp_path: Path):
    site_dir = tmp_path / "site"
    write_distribution(site_dir, "acme-cli-broken", "1.0", {"wtransfer.specs": {"bad": "acme_cli_broken:Nope"}},
                       {"acme_cli_broken": "X = 1\n"})
    code = "from wtransfer.cli import main; raise SystemExit(main(['check', '--json']))"
    failed = run_python(code, path=[site_dir], check=False)
    assert failed.returncode == 1
    bad = [r for r in json.loads(failed.stdout) if r["name"] == "bad"]
    assert bad[0]["status"] == "broken" and "acme-cli-broken" in bad[0]["problem"]
    disabled = run_python(code, path=[site_dir], check=False,
                          env={"WTRANSFER_DISABLE_PLUGINS": "acme-cli-broken"})
    rows = json.loads(disabled.stdout)
    assert [r["status"] for r in rows if r["name"] == "bad"] == ["disabled"]
    others_broken = [r for r in rows if r["status"] in ("broken", "conflict")]
    assert disabled.returncode == (1 if others_broken else 0)


def test_python_dash_m_and_table_output():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "wtransfer", "list", "engine"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "shm" in out.stdout and "gloo" in out.stdout and "wtransfer 0.1.0" in out.stdout
    assert "storage" not in out.stdout  # only the asked kind


def _code_strings(source: str) -> list[str]:
    """String constants of a module that are not docstrings."""
    import ast

    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_core_never_names_the_nccl_plugin_module():
    """The NCCL engine is found through its distribution's metadata; only the hint table names it."""
    package = Path(wtransfer.__file__).parent
    sources = {str(p.relative_to(package)): p.read_text() for p in package.rglob("*.py")}
    assert [name for name, text in sources.items() if "wtransfer_nccl" in text] == []
    in_code = sorted(name for name, text in sources.items()
                     if any("wtransfer-nccl" in value for value in _code_strings(text)))
    assert in_code == ["_registry/hints.py"]


def test_bench_help_reaches_the_suite():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "wtransfer", "bench", "--help"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "--engine" in out.stdout and "wtransfer bench weights" in out.stdout
    out = subprocess.run([sys.executable, "-m", "benchmarks", "discovery", "--help"], cwd=Path(__file__).parent.parent,
                         capture_output=True, text=True, timeout=60, check=True)
    assert "--dists" in out.stdout and "python -m benchmarks discovery" in out.stdout
