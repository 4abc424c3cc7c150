"""The conformance kit itself: fixtures arrive through pytest11, and suites fail a broken plugin."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import wtransfer
from wtransfer._registry.registry import registry_for

LEAKY_SPEC = '''
from wtransfer.specs._base import OffloadingManager
from wtransfer.specs.cpu import CPUOffloadingSpec


class LeakyManager(OffloadingManager):
    """Delegates to a correct manager but reports failed stores as stored: one contract violation."""

    def __init__(self, inner):
        self._inner = inner

    def complete_store(self, block_hashes, success=True):
        self._inner.complete_store(block_hashes, success=True)

    def lookup(self, block_hashes):
        return self._inner.lookup(block_hashes)

    def prepare_load(self, block_hashes):
        return self._inner.prepare_load(block_hashes)

    def touch(self, block_hashes):
        self._inner.touch(block_hashes)

    def complete_load(self, block_hashes):
        self._inner.complete_load(block_hashes)

    def prepare_store(self, block_hashes):
        return self._inner.prepare_store(block_hashes)

    def take_events(self):
        return self._inner.take_events()


class LeakySpec(CPUOffloadingSpec):
    def get_manager(self):
        if not hasattr(self, "_leaky"):
            self._leaky = LeakyManager(super().get_manager())
        return self._leaky
'''


def run_pytest(test_dir: Path, source: str) -> subprocess.CompletedProcess[str]:
    (test_dir / "test_plugin_suite.py").write_text(textwrap.dedent(source))
    # No conftest: the fixtures and suites must come from wtransfer's pytest11 plugin.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_dir)],
                          capture_output=True, text=True, timeout=300, cwd=test_dir)


def test_a_broken_spec_fails_with_an_explanation(fake_distribution, tmp_path: Path):
    fake_distribution("acme-leaky", {"wtransfer.specs": {"leaky": "acme_leaky:LeakySpec"}},
                      {"acme_leaky": LEAKY_SPEC})
    out = run_pytest(tmp_path, """
        import pytest
        from wtransfer.testing.conformance import SpecConformance

        class TestLeaky(SpecConformance):
            spec = "leaky"

            @pytest.fixture
            def spec_options(self):
                return {"num_cpu_blocks": 4}
    """)
    assert out.returncode == 1, out.stdout
    assert "contract point: a failed store is not reported as stored" in out.stdout
    assert "expected: lookup == 0" in out.stdout
    # every other point of the contract still holds, under each cache layout the spec declares
    assert "2 failed" in out.stdout
    assert failed_tests(out.stdout) == [
        "test_failed_store_frees_its_space[vllm-cpu]", "test_failed_store_frees_its_space[wtransfer]"]


FORGETFUL_ENGINE = '''
from wtransfer.engines.shm import SharedMemoryWeightTransferEngine


class DropsNorm:
    """Forwards a loader (its manifest check and in-place destinations too) but never loads 'norm', whether it
    comes to the call or to its destination."""

    def __init__(self, inner):
        self._inner = inner

    def __call__(self, weights):
        self._inner([(name, tensor) for name, tensor in weights if name != "norm"])

    def destination(self, name):
        return None if name == "norm" else self._inner.destination(name)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Forgetful(SharedMemoryWeightTransferEngine):
    """shm with one contract violation: one small tensor silently never reaches the model."""

    def receive_weights(self, update_info, load_weights):
        super().receive_weights(update_info, DropsNorm(load_weights))
'''

SWALLOWING_ENGINE = '''
from wtransfer.engines.shm import SharedMemoryWeightTransferEngine
from wtransfer.errors import TransferError


class Swallower(SharedMemoryWeightTransferEngine):
    """shm with one contract violation: a round cut short is reported as received (its error is
    swallowed), so the control plane is told a round that died half-way went through."""

    def receive_weights(self, update_info, load_weights):
        try:
            super().receive_weights(update_info, load_weights)
        except TransferError:
            pass
'''

PLAIN_WRAPPER_ENGINE = '''
from wtransfer.engines.shm import SharedMemoryWeightTransferEngine


class Plain(SharedMemoryWeightTransferEngine):
    """shm with a faithful wrapper, as an author who logs or renames would write it: every tensor still
    reaches load_weights, through a plain function that hides the framework loader's own methods."""

    def receive_weights(self, update_info, load_weights):
        def plain(batch):
            load_weights(list(batch))

        super().receive_weights(update_info, plain)
'''

TOKEN_KEYED_CONNECTOR = '''
import dataclasses

from wtransfer import block_hashes
from wtransfer.connectors.storage import StorageConnector

ANY_MODEL = "00" * 32  # one namespace for every model


class TokenKeyed(StorageConnector):
    """storage with one contract violation: blocks are keyed by their tokens alone, so KV saved
    for one model is offered to another (and across cache salts, adapters, weight updates)."""

    def _by_tokens(self, request):
        return dataclasses.replace(request, block_hashes=block_hashes(ANY_MODEL, request.token_ids, self.block_size))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return super().get_num_new_matched_tokens(self._by_tokens(request), num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        super().update_state_after_alloc(self._by_tokens(request), block_ids, num_external_tokens)

    def build_connector_meta(self, step):
        scheduled = [dataclasses.replace(entry, request=self._by_tokens(entry.request)) for entry in step.scheduled]
        return super().build_connector_meta(dataclasses.replace(step, scheduled=scheduled))
'''


def failed_tests(stdout: str) -> list[str]:
    return sorted(line.split("::")[-1].split(" ")[0] for line in stdout.splitlines() if line.startswith("FAILED"))


def test_a_broken_engine_fails_exactly_its_point(fake_distribution, tmp_path: Path):
    fake_distribution("acme-forgetful", {"wtransfer.engines": {"forgetful": "acme_forgetful:Forgetful"}},
                      {"acme_forgetful": FORGETFUL_ENGINE})
    out = run_pytest(tmp_path, """
        from wtransfer.testing.conformance import EngineConformance

        class TestForgetful(EngineConformance):
            engine = "forgetful"
    """)
    assert out.returncode == 1, out.stdout
    # streamed, the round "completes" without 'norm' and the weights show it; atomic, the framework
    # finds the tensor never delivered and fails the round before any model sees it
    assert "contract point: every worker holds the trainer's weights bit for bit after a round" in out.stdout
    assert "differs in ['norm']" in out.stdout
    assert "never delivered (first: ['norm'])" in out.stdout
    # exactly the points whose rounds must complete; the failure paths (dead or silent peers) hold
    assert failed_tests(out.stdout) == sorted([
        *(f"{test}[{commit}]" for test in (
            "test_dead_trainer_fails_the_workers_within_the_timeout",
            "test_one_worker_rejecting_leaves_every_worker_unchanged_and_the_trainer_usable",
            "test_rounds_are_bit_exact_on_the_dtype_shape_matrix",
            "test_delta_rounds_rebuild_the_trainers_weights_bit_exactly",  # its first round is whole
        ) for commit in ("atomic", "streaming")),
        "test_reconnects_to_workers_that_restarted",  # atomic: the round after reconnect() fails too
    ]), out.stdout


def test_an_engine_that_wraps_its_loader_in_a_plain_function_passes_every_point(fake_distribution, tmp_path: Path):
    # The framework checks each round against the model (and a delta round's base) before the engine
    # runs, so rejection before any byte, delta rounds and both commit modes hold whatever the engine
    # does with its loader. Broken by: checking only when the engine calls its loader's validate_manifest.
    fake_distribution("acme-plain", {"wtransfer.engines": {"plain": "acme_plain:Plain"}},
                      {"acme_plain": PLAIN_WRAPPER_ENGINE})
    out = run_pytest(tmp_path, """
        from wtransfer.testing.conformance import EngineConformance

        class TestPlain(EngineConformance):
            engine = "plain"
    """)
    assert out.returncode == 0 and failed_tests(out.stdout) == [], out.stdout
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout


def test_an_engine_that_tears_silently_fails_exactly_the_torn_round_point(fake_distribution, tmp_path: Path):
    fake_distribution("acme-swallower", {"wtransfer.engines": {"swallower": "acme_swallower:Swallower"}},
                      {"acme_swallower": SWALLOWING_ENGINE})
    out = run_pytest(tmp_path, """
        from wtransfer.testing.conformance import EngineConformance

        class TestSwallower(EngineConformance):
            engine = "swallower"
    """)
    assert out.returncode == 1, out.stdout
    # Its weights are honest even so (a streamed round received but never committed reports torn), so
    # what the kit catches is the error it swallowed.
    assert "contract point: workers whose trainer died mid-round raise a TransferError" in out.stdout, out.stdout
    # atomic rounds catch the lie themselves (the staged copy is incomplete): only streaming fails
    assert failed_tests(out.stdout) == ["test_dead_trainer_fails_the_workers_within_the_timeout[streaming]"], \
        out.stdout


def test_a_broken_connector_fails_exactly_its_point(fake_distribution, tmp_path: Path):
    fake_distribution("acme-tokenkeyed", {"wtransfer.connectors": {"tokenkeyed": "acme_tokenkeyed:TokenKeyed"}},
                      {"acme_tokenkeyed": TOKEN_KEYED_CONNECTOR})
    out = run_pytest(tmp_path, """
        import pytest
        from wtransfer.testing.conformance import ConnectorConformance

        class TestTokenKeyed(ConnectorConformance):
            connector = "tokenkeyed"
            persistent = True

            @pytest.fixture
            def connector_options(self, tmp_path):
                return {"path": str(tmp_path / "kv")}
    """)
    assert out.returncode == 1, out.stdout
    assert "contract point: blocks are identified by the request's block hashes" in out.stdout
    # every other point holds, under each layout the connector declares
    assert failed_tests(out.stdout) == [
        "test_another_model_never_matches[vllm-cpu]", "test_another_model_never_matches[wtransfer]"], out.stdout


def test_fixtures_isolate_registrations_and_distributions(tmp_path: Path):
    out = run_pytest(tmp_path, """
        import subprocess, sys
        import wtransfer
        from wtransfer import WeightTransferEngineFactory
        from wtransfer._registry.registry import registry_for

        ENGINE = "from wtransfer.engines.shm import SharedMemoryWeightTransferEngine as Probe"

        def test_register_inside(isolated_registry):
            WeightTransferEngineFactory.register_engine("leak-probe", "json", "JSONDecoder")
            assert "leak-probe" in registry_for("engines").names()

        def test_not_leaked():
            assert "leak-probe" not in registry_for("engines").names()

        def test_fake_distribution_seen_here_and_in_children(fake_distribution):
            fake_distribution("acme-probe", {"wtransfer.engines": {"probe": "acme_probe:Probe"}},
                              {"acme_probe": "from wtransfer.engines.worker.base import WeightTransferEngine as Probe"})
            assert "probe" in registry_for("engines").names()
            child = subprocess.run([sys.executable, "-c",
                "from wtransfer._registry.registry import registry_for; print('probe' in registry_for('engines').names())"],
                capture_output=True, text=True, check=True)
            assert child.stdout.strip() == "True"

        def test_fake_distribution_removed_afterwards():
            assert "probe" not in registry_for("engines").names()
    """)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 passed" in out.stdout
    assert "leak-probe" not in registry_for("engines").names()
    assert "probe" not in {i.name for i in wtransfer.list_components("engines")}


def test_example_plugin_passes_its_own_conformance_suite(installed_example: Path, example_plugin_source: Path):
    """The plugin-author workflow end to end: build, pip install, run the plugin's own tests."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(installed_example),
                                                                     os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=example_plugin_source, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "failed" not in out.stdout
