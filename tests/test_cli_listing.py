"""What a new user sees from ``wtransfer list`` / ``wtransfer check``, against real pip-installed plugins.

Every distribution here is a real project (pyproject.toml + modules) built and ``pip install``-ed
into its own ``--target`` directory, and the CLI runs as ``python -m wtransfer`` in a fresh
interpreter with that directory prepended to ``PYTHONPATH`` (as the other registry tests do).
Each test names the broken implementation it catches.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from demo_engine import demo_engine_module


def engine_source(prefix: str = "") -> str:
    return demo_engine_module(prefix=prefix)


LONG_DIST = "acme-extremely-long-distribution-name-for-weight-transfer-backends"
LONG_ENGINE = "very-long-engine-name-number-one"
LONG_QUALIFIED = f"{LONG_DIST}:{LONG_ENGINE}"

# name -> (version, {group: {entry point: value}}, {module: source}); "{marker}" is filled in per session.
PROJECTS: dict[str, tuple[str, dict[str, dict[str, str]], dict[str, str]]] = {
    # A distribution that fails to import: its engine and spec raise, its hook module lacks a dependency.
    "acme-broken": ("0.3", {
        "wtransfer.engines": {"twin": "acme_broken.engine:DemoEngine"},
        "wtransfer.specs": {"broken-spec": "acme_broken.spec:Spec"},
        "wtransfer.plugins": {"acme": "acme_broken.hooks"},
    }, {
        "acme_broken.engine": "raise RuntimeError('boom at import')\n",
        "acme_broken.spec": "raise RuntimeError('boom at import')\n",
        "acme_broken.hooks": "raise ImportError('missing dependency acme-lib')\n",
    }),
    # A working engine under the same name as acme-broken's: a real conflict.
    "acme-twin": ("1.0", {"wtransfer.engines": {"twin": "acme_twin.engine:DemoEngine"}},
                  {"acme_twin.engine": engine_source()}),
    # A working hook plugin, and an engine whose import leaves a marker (listing must not import it).
    "acme-hooks": ("2.1", {
        "wtransfer.plugins": {"observer": "acme_hooks.hooks"},
        "wtransfer.engines": {"lazy": "acme_hooks.engine:DemoEngine"},
    }, {
        "acme_hooks.hooks": "import wtransfer\n\n@wtransfer.hookimpl\ndef wtransfer_engine_created(engine):\n"
                            "    pass\n",
        "acme_hooks.engine": engine_source("open({marker!r}, 'a').write('imported\\n')"),
    }),
    # A hook module that uses wtransfer while it is imported (runtime registrations, as plugins do).
    "acme-registers": ("1.0", {"wtransfer.plugins": {"registers": "acme_registers.hooks"}}, {
        "acme_registers.hooks": textwrap.dedent("""
            from wtransfer import OffloadingSpecFactory, WeightTransferEngineFactory

            WeightTransferEngineFactory.register_engine("registered-at-import", "acme_registers.engine", "DemoEngine")
            OffloadingSpecFactory.register_spec("registered-at-import", "acme_registers.spec", "Spec")
        """),
        "acme_registers.engine": engine_source(),
    }),
    # A hook plugin contributing components through wtransfer_components (not entry points).
    "acme-contributes": ("1.0", {"wtransfer.plugins": {"contributes": "acme_contributes.hooks"}}, {
        "acme_contributes.hooks": textwrap.dedent("""
            import wtransfer

            TARGETS = {"engines": "acme_contributes.engine:DemoEngine", "specs": "acme_contributes.spec:Spec"}

            @wtransfer.hookimpl
            def wtransfer_components(kind):
                if kind not in TARGETS:
                    return []
                return [wtransfer.ComponentRef(kind, "contributed", TARGETS[kind], "acme-contributes", "1.0",
                                               origin="hook")]
        """),
        "acme_contributes.engine": engine_source(),
    }),
    LONG_DIST: ("12.34.56", {"wtransfer.engines": {LONG_ENGINE: "acme_long.engine:DemoEngine"}},
                {"acme_long.engine": engine_source()}),
}


def build_project(root: Path, name: str, version: str, groups: Mapping[str, Mapping[str, str]],
                  modules: Mapping[str, str]) -> Path:
    """A real source tree: pyproject.toml declaring the entry points, plus the modules."""
    lines = ["[build-system]", 'requires = ["setuptools>=68"]', 'build-backend = "setuptools.build_meta"', "",
             "[project]", f'name = "{name}"', f'version = "{version}"', ""]
    for group, entries in groups.items():
        lines.append(f'[project.entry-points."{group}"]')
        lines.extend(f'"{ep}" = "{value}"' for ep, value in entries.items())
        lines.append("")
    packages = sorted({module.split(".")[0] for module in modules})
    lines += ["[tool.setuptools]", f"packages = {json.dumps(packages)}", ""]
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text("\n".join(lines))
    for dotted, source in modules.items():
        path = root.joinpath(*dotted.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(source)
    return root


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each project of PROJECTS really built and pip-installed into its own target directory."""
    base = tmp_path_factory.mktemp("cli-listing")
    marker = base / "lazy-engine-imported.txt"
    targets: dict[str, Path] = {"marker": marker}
    for name, (version, groups, modules) in PROJECTS.items():
        modules = {m: s.replace("{marker!r}", repr(str(marker))) for m, s in modules.items()}
        source = build_project(base / "src" / name, name, version, groups, modules)
        target = base / "target" / name
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
             "--target", str(target), str(source)],
            check=True, capture_output=True, text=True, timeout=300,
        )
        assert list(target.glob("*.dist-info")), f"pip installed no distribution for {name}"
        targets[name] = target
    return targets


def _env(path: Sequence[Path]) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("WTRANSFER_DISABLE_PLUGINS", "WTRANSFER_TRACE", "COLUMNS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def wtransfer(
    *args: str, path: Sequence[Path], cwd: Path, expect: int | None = 0
) -> subprocess.CompletedProcess[str]:
    """``python -m wtransfer ARGS`` in a fresh interpreter that sees the distributions in ``path``.

    ``expect=None`` accepts any exit status (``check`` exits 1 when anything installed in the
    running environment is broken; the rows say what).
    """
    out = subprocess.run([sys.executable, "-m", "wtransfer", *args], env=_env(path), cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert expect is None or out.returncode == expect, f"exit {out.returncode}\n--- stdout ---\n{out.stdout}\n--- stderr ---\n{out.stderr}"
    return out


def wtransfer_in_terminal(*args: str, path: Sequence[Path], cwd: Path, columns: int) -> str:
    """``python -m wtransfer ARGS`` with a pseudo-terminal of ``columns`` columns as its stdout."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = _env(path) | {"COLUMNS": str(columns), "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "wtransfer", *args], env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    chunks: list[bytes] = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            assert ready, "the CLI wrote nothing for 60 s"
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # colours and styles


def rows_of(stdout: str) -> list[dict]:
    return json.loads(stdout)


def cells(line: str) -> list[str]:
    """The cells of one table row (rich draws ``│`` between them)."""
    return [cell.strip() for cell in line.strip().strip("│").split("│")]


HOOK_WARNING = "Skipping hook plugin"


# -- 1. hook plugins are listed ----------------------------------------------------------------------


def test_list_shows_hook_plugins_with_their_status_and_components_unchanged(installed, tmp_path: Path):
    """Catches: ``list`` leaving hook plugins out (table or JSON), a broken one shown without its
    error, component rows of ``list --json`` changed, ``list KIND`` mixing hook plugins into a
    kind, and listing that imports a component module."""
    path = [installed["acme-hooks"], installed["acme-broken"]]
    marker = installed["marker"]

    table = wtransfer("list", path=path, cwd=tmp_path).stdout
    assert "wtransfer hook plugins" in table
    lines = table.splitlines()
    observer = [line for line in lines if "acme_hooks.hooks" in line]
    assert len(observer) == 1 and "observer" in observer[0] and "acme-hooks 2.1" in observer[0]
    assert "loaded" in observer[0]
    broken = [line for line in lines if "acme_broken.hooks" in line]
    assert len(broken) == 1 and "broken" in broken[0] and "ImportError: missing dependency acme-lib" in broken[0]

    rows = rows_of(wtransfer("list", "--json", path=path, cwd=tmp_path).stdout)
    components = [r for r in rows if r["kind"] != "hook plugin"]
    hooks = [r for r in rows if r["kind"] == "hook plugin"]
    assert all(set(r) == {"kind", "name", "distribution", "version", "target", "status"} for r in components)
    assert {r["kind"] for r in components} <= {"engines", "connectors", "specs", "policies"}
    assert [r for r in components if r["name"] == "lazy"] == [
        {"kind": "engines", "name": "lazy", "distribution": "acme-hooks", "version": "2.1",
         "target": "acme_hooks.engine:DemoEngine", "status": "available"}]
    assert sorted(hooks, key=lambda r: r["name"]) == [
        {"kind": "hook plugin", "name": "acme", "distribution": "acme-broken", "version": "0.3",
         "target": "acme_broken.hooks", "status": "broken", "problem": "ImportError: missing dependency acme-lib"},
        {"kind": "hook plugin", "name": "observer", "distribution": "acme-hooks", "version": "2.1",
         "target": "acme_hooks.hooks", "status": "loaded", "problem": None},
    ]
    only_hooks = rows_of(wtransfer("list", "plugins", "--json", path=path, cwd=tmp_path).stdout)
    assert sorted(only_hooks, key=lambda r: r["name"]) == sorted(hooks, key=lambda r: r["name"])
    engines = rows_of(wtransfer("list", "engines", "--json", path=path, cwd=tmp_path).stdout)
    assert engines and {r["kind"] for r in engines} == {"engines"}
    assert not marker.exists(), "wtransfer list imported a component module"


def test_list_says_when_there_are_no_hook_plugins(installed, tmp_path: Path):
    """Catches: a hook-plugin section that silently disappears (or lists phantom rows) when none is installed."""
    out = wtransfer("list", path=[installed["acme-twin"]], cwd=tmp_path)
    hooks = [r for r in rows_of(wtransfer("list", "--json", path=[installed["acme-twin"]], cwd=tmp_path).stdout)
             if r["kind"] == "hook plugin"]
    if hooks:  # the running environment has hook plugins of its own: then they are tabled
        assert "wtransfer hook plugins" in out.stdout
    else:
        assert "No hook plugins installed" in out.stdout


# -- 2. a distribution that fails to import ------------------------------------------------------------


def test_broken_distribution_shows_its_import_error_not_several_providers(installed, tmp_path: Path):
    """Catches: ``check`` overwriting a provider's import error with "has several providers"
    because its name is also provided elsewhere (the error that says what to fix was lost)."""
    path = [installed["acme-broken"], installed["acme-twin"]]
    checked = wtransfer("check", "--json", path=path, cwd=tmp_path, expect=1)
    rows = {(r["kind"], r["distribution"], r["name"]): r for r in rows_of(checked.stdout)}

    broken_engine = rows["engines", "acme-broken", "twin"]
    assert broken_engine["status"] == "broken"
    assert "RuntimeError: boom at import" in broken_engine["problem"]
    assert "acme-broken" in broken_engine["problem"] and "several providers" not in broken_engine["problem"]
    broken_spec = rows["specs", "acme-broken", "broken-spec"]
    assert broken_spec["status"] == "broken" and "RuntimeError: boom at import" in broken_spec["problem"]
    hook = rows["hook plugin", "acme-broken", "acme"]
    assert hook["status"] == "broken" and hook["problem"] == "ImportError: missing dependency acme-lib"

    # The provider that does load is the one flagged as ambiguous, naming both qualified names.
    twin = rows["engines", "acme-twin", "twin"]
    assert twin["status"] == "conflict"
    assert "'twin' has several providers" in twin["problem"]
    assert "acme-broken:twin" in twin["problem"] and "acme-twin:twin" in twin["problem"]

    table = wtransfer("check", path=path, cwd=tmp_path, expect=1).stdout
    broken_lines = [line for line in table.splitlines() if cells(line)[1:2] == ["acme-broken:twin"]]
    assert len(broken_lines) == 1 and "broken" in broken_lines[0] and "several providers" not in broken_lines[0]
    assert "FAILED" in table


# -- 3. a broken hook plugin is warned about once ---------------------------------------------------------


@pytest.mark.parametrize("command", [("list",), ("list", "--json"), ("check",), ("check", "--json")])
def test_a_broken_hook_plugin_is_warned_about_once(installed, tmp_path: Path, command: tuple[str, ...]):
    """Catches: the hook manager built twice in one process. A hook module that registers an
    engine while it is imported re-enters the manager before it is stored; a second build then
    imported every hook module again: two warnings, and two rows per hook plugin in ``check``."""
    for order in (["acme-broken", "acme-registers"], ["acme-registers", "acme-broken"]):
        path = [installed[name] for name in order]
        out = wtransfer(*command, path=path, cwd=tmp_path, expect=1 if command[0] == "check" else 0)
        warnings = [line for line in out.stderr.splitlines() if HOOK_WARNING in line]
        assert len(warnings) == 1, (order, out.stderr)
        assert "acme_broken.hooks" in warnings[0] and "missing dependency acme-lib" in warnings[0]
        if "--json" in command:
            hooks = [(r["distribution"], r["name"]) for r in rows_of(out.stdout) if r["kind"] == "hook plugin"]
            assert sorted(hooks) == [("acme-broken", "acme"), ("acme-registers", "registers")], order


def test_a_lookup_while_hook_plugins_load_does_not_hide_later_contributions(installed, tmp_path: Path):
    """Catches: the obvious fix for the double build (hand the half-built manager to the
    re-entrant call) when the registry then caches what that half-built manager answered:
    components contributed by hook plugins registered later would be missing for good (here:
    the specs registry, asked by acme-registers while listing engines started the manager)."""
    path = [installed["acme-registers"], installed["acme-contributes"]]  # acme-registers is imported first
    rows = rows_of(wtransfer("list", "--json", path=path, cwd=tmp_path).stdout)
    found = {(r["kind"], r["name"]): r["distribution"] for r in rows}
    for kind in ("engines", "specs"):
        assert found[kind, "contributed"] == "acme-contributes", kind
        assert found[kind, "registered-at-import"] is None, kind  # a runtime registration of that process
    checked = rows_of(wtransfer("check", "--json", path=path, cwd=tmp_path, expect=None).stdout)
    statuses = {r["name"]: r["status"] for r in checked if r["kind"] in ("engines", "hook plugin")}
    assert statuses["contributed"] == "ok" and statuses["registered-at-import"] == "ok"
    assert statuses["registers"] == "ok" and statuses["contributes"] == "ok"


# -- 4. qualified names are never cut ------------------------------------------------------------------------


def test_qualified_names_are_not_truncated_in_tables(installed, tmp_path: Path):
    """Catches: table cells folded or cut at the output width (rich's default): a long
    ``distribution:name`` split over two lines cannot be copied or grepped."""
    path = [installed[LONG_DIST]]
    listed = wtransfer("list", path=path, cwd=tmp_path).stdout
    line = [line for line in listed.splitlines() if LONG_ENGINE in line]
    assert line and LONG_QUALIFIED in line[0], listed
    assert "12.34.56" in line[0]
    checked = wtransfer("check", path=path, cwd=tmp_path, expect=None).stdout
    assert any(LONG_QUALIFIED in line and "ok" in line for line in checked.splitlines()), checked

    # On a terminal narrower than the names, the names still come out whole (the table grows instead).
    shown = wtransfer_in_terminal("list", "engines", path=path, cwd=tmp_path, columns=80)
    line = [line for line in shown.splitlines() if LONG_ENGINE in line]
    assert line and LONG_QUALIFIED in line[0], shown
    assert "shm" in shown and "wtransfer:shm" in shown
