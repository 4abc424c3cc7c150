"""wtransfer's pytest plugin, registered through the ``pytest11`` entry point.

Installing wtransfer gives every test suite these fixtures:

* ``isolated_registry`` — runtime registrations made during the test are undone after it, and installed
  distributions are rescanned before and after.
* ``fake_distribution`` — ``fake_distribution(name, entry_points, modules=..., version=...)`` writes a real
  ``.dist-info`` (plus modules) into a private site directory on ``sys.path`` and ``PYTHONPATH`` (so subprocesses
  see it too), then rescans.
* ``paged_engine`` — a factory for the tiny paged KV engine (:mod:`wtransfer.testing.paged_engine`).

and the conformance classes in :mod:`wtransfer.testing.conformance` to subclass. pytest imports this module at
start-up in every project with wtransfer installed, so it stays light and changes nothing until a test asks for a
fixture: no autouse fixture, marker, option or hook that runs in an unrelated session
(``tests/test_pytest_plugin_inert.py`` holds it to that).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from wtransfer.testing.distributions import EntryPoints, site_on_path, write_distribution


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    """Undo runtime registrations made by the test; rescan installed components around it."""
    from wtransfer._registry.kinds import KINDS
    from wtransfer._registry.registry import refresh, registry_for

    snapshots = {name: registry_for(name).snapshot() for name in KINDS}
    refresh()
    try:
        yield
    finally:
        for name, snapshot in snapshots.items():
            registry_for(name).restore(snapshot)
        refresh()


FakeDistribution = Callable[..., Path]


@pytest.fixture
def fake_distribution(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, isolated_registry: None
) -> Iterator[FakeDistribution]:
    """Factory writing real installed distributions visible to this process and its children."""
    from wtransfer._registry.registry import refresh

    site = tmp_path_factory.mktemp("fake-site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))

    def make(
        name: str,
        entry_points: EntryPoints,
        modules: Mapping[str, str] | None = None,
        version: str = "1.0",
    ) -> Path:
        info = write_distribution(site, name, version, entry_points, modules)
        importlib.invalidate_caches()
        refresh()
        return info

    with site_on_path(site):
        yield make


@pytest.fixture
def paged_engine() -> Iterator[Callable[..., Any]]:
    """Factory for the tiny paged KV engine (same arguments as ``PagedKVEngine``); engines made through it are shut
    down after the test."""
    from wtransfer.testing.paged_engine import PagedKVEngine

    engines: list[PagedKVEngine] = []

    def make(*args: Any, **kwargs: Any) -> PagedKVEngine:
        engine = PagedKVEngine(*args, **kwargs)
        engines.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in engines:
            engine.shutdown()
