"""Components declared in a TOML file (``WTRANSFER_COMPONENTS``): the second contributor of
``wtransfer_components``, checked where it matters: in processes the job spawns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import wtransfer
from wtransfer import WeightTransferConfig, WeightTransferEngineFactory
from wtransfer.testing.processes import run_python

ENGINE_MODULE = '''
from wtransfer.engines import SharedMemoryTrainer, SharedMemoryWeightTransferEngine


class FastShmTrainer(SharedMemoryTrainer):
    backend = "fast-shm"


class FastShmEngine(SharedMemoryWeightTransferEngine):
    """shm under another name: what a team tries from a checkout before packaging it."""

    trainer_cls = FastShmTrainer
'''


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A source checkout (not pip-installed) with one engine, and a components file naming it."""
    package = tmp_path / "checkout" / "team_backends"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engines.py").write_text(ENGINE_MODULE)
    components = tmp_path / "team-backends.toml"
    components.write_text('distribution = "team"\n[engines]\nfast-shm = "team_backends.engines:FastShmEngine"\n')
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("WTRANSFER_COMPONENTS", str(components))
    wtransfer.refresh()
    yield components
    monkeypatch.delenv("WTRANSFER_COMPONENTS")
    wtransfer.refresh()


def test_spawned_workers_resolve_a_component_from_the_file(checkout: Path):
    """Catches: the file read only by the process that set it up (as ``register_engine`` is): the
    pool's workers are spawned interpreters that find the engine through the inherited variable."""
    out = run_python(
        """
        import json, torch, wtransfer
        from wtransfer.local import LocalWorkerPool
        from wtransfer.testing.models import digests, matrix_model

        model = matrix_model(seed=7)
        with LocalWorkerPool(2, "wtransfer.testing.models:matrix_model", backend="fast-shm", timeout_s=60) as pool:
            trainer = wtransfer.create_trainer("team:fast-shm", client=pool, source=model,
                                               init_info={"world_size": pool.world_size})
            try:
                trainer.send_weights()
                same = all(got == digests(model) for got in pool.digests())
            finally:
                trainer.shutdown()
        info = [i.to_dict() for i in wtransfer.list_components("engines") if i.name == "fast-shm"]
        print(json.dumps({"same": same, "trainer": type(trainer).__name__, "info": info}))
        """,
        path=[checkout.parent / "checkout"], timeout=180,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"] and result["trainer"] == "FastShmTrainer"
    (info,) = result["info"]
    assert (info["distribution"], info["target"]) == ("team", "team_backends.engines:FastShmEngine")


def test_a_components_file_follows_the_registry_rules(checkout: Path, monkeypatch: pytest.MonkeyPatch):
    """Catches: file components bypassing laziness, disabling or the conflict policy."""
    import sys

    listed = {i.name: i for i in wtransfer.list_components("engines")}
    assert listed["fast-shm"].distribution == "team" and listed["fast-shm"].status == "available"
    assert "team_backends.engines" not in sys.modules  # listed from the file, not imported
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="fast-shm"))
    assert type(engine).__name__ == "FastShmEngine"

    for value in ("team", "engines:fast-shm"):
        monkeypatch.setenv("WTRANSFER_DISABLE_PLUGINS", value)
        wtransfer.refresh()
        with pytest.raises(wtransfer.DisabledComponentError):
            WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="fast-shm"))
    monkeypatch.delenv("WTRANSFER_DISABLE_PLUGINS")

    # A file may not shadow an installed name silently: the bare name becomes ambiguous.
    checkout.write_text('distribution = "team"\n[engines]\nshm = "team_backends.engines:FastShmEngine"\n')
    wtransfer.refresh()
    with pytest.raises(wtransfer.AmbiguousComponentError, match="team:shm"):
        WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="shm"))
    assert type(WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="wtransfer:shm"))).__name__ \
        == "SharedMemoryWeightTransferEngine"


@pytest.mark.parametrize("text, fragment", [
    (None, "does not exist; fix the path or unset WTRANSFER_COMPONENTS"),
    ("[engines\n", "cannot read"),
    ('[engine]\nx = "a.b:C"\n[widgets]\ny = "a:b"\n', "unknown table(s) 'widgets'"),
    ('[engines]\nx = "a.b.C"\n', 'write name = "package.module:Class"'),
    ('distribution = "a:b"\n', "'distribution' must be a name without ':'"),
    ('distribution = "WTransfer"\n', "is the name of an installed distribution providing wtransfer components"),
])
def test_a_bad_components_file_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     text: str | None, fragment: str):
    """Catches: a typo in the file (or its path) skipped silently, the user's engine then missing."""
    path = tmp_path / "components.toml"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv("WTRANSFER_COMPONENTS", str(path))
    wtransfer.refresh()
    try:
        with pytest.raises(wtransfer.InvalidComponentError, match=str(path).replace(".", r"\.")) as info:
            WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="shm"))
        assert fragment in str(info.value)
    finally:
        monkeypatch.delenv("WTRANSFER_COMPONENTS")
        wtransfer.refresh()


def test_a_relative_path_is_refused_and_the_cli_reports_without_a_traceback(tmp_path: Path):
    """Catches: a relative path that each process resolves from its own working directory (another
    file, or none, in a worker), and ``wtransfer list`` (the diagnostic tool) crashing on it."""
    out = run_python(
        """
        import sys
        from wtransfer.cli import main
        sys.exit(main(["list"]))
        """,
        env={"WTRANSFER_COMPONENTS": "team.toml"}, check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "WTRANSFER_COMPONENTS names team.toml: give absolute paths" in out.stderr
