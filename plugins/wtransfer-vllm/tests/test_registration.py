"""Registration inside a real vLLM: what ``vllm.plugins.load_general_plugins()`` leaves in its factories.

Each check runs in a fresh interpreter of the vLLM environment, with third-party
distributions really pip-installed into a target directory on its ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from vllm_harness import REPO_ROOT, pip_install_into, run_script

LOAD = """
import json, sys
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F, WeightTransferTrainerFactory as T
"""


def write_acme(root: Path) -> Path:
    """A third-party distribution that clashes with wtransfer's ``shm``, ships a broken
    engine entry point and a hook module that fails to import."""
    package = root / "acme-dup"
    (package / "acme_dup").mkdir(parents=True)
    (package / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "acme-dup"
        version = "1.0"
        [project.entry-points."wtransfer.engines"]
        shm = "acme_dup.engine:AcmeShm"
        broken = "acme_dup.missing:Nothing"
        [project.entry-points."wtransfer.plugins"]
        acme = "acme_dup.hooks"
        [tool.setuptools]
        packages = ["acme_dup"]
    """))
    (package / "acme_dup" / "__init__.py").write_text("")
    (package / "acme_dup" / "engine.py").write_text(
        "import wtransfer\n"
        "class AcmeShm(wtransfer.get_class('engines', 'wtransfer:shm')):\n    pass\n"
    )
    (package / "acme_dup" / "hooks.py").write_text("raise RuntimeError('acme hooks are broken')\n")
    return package


@pytest.fixture(scope="module")
def third_party(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugin, wtransfer-nccl and acme-dup, pip-installed into one target directory."""
    target = tmp_path_factory.mktemp("site")
    sources = [REPO_ROOT / "tests" / "example_plugin", REPO_ROOT / "plugins" / "wtransfer-nccl",
               write_acme(tmp_path_factory.mktemp("acme"))]
    return pip_install_into(vllm_python, target, *sources)


def load(python: Path, code: str, site: Path | None = None) -> dict:
    env = {"PYTHONPATH": str(site)} if site else {}
    out = run_script(python, "-c", LOAD + textwrap.dedent(code), env=env, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_builtins_registered_lazily_under_both_names(vllm_python: Path) -> None:
    got = load(vllm_python, """
        before = sorted(m for m in sys.modules if m.startswith("wtransfer.engines."))
        cls = F._registry["shm"]()          # what vLLM's create_engine looks up
        after = sorted(m for m in sys.modules if m.startswith("wtransfer.engines."))
        print(json.dumps({"engines": sorted(F._registry), "trainers": sorted(T._registry),
                          "cls": cls.__name__, "backend": cls.wtransfer_backend,
                          "same": F._registry["wtransfer:shm"]() is cls, "before": before, "after": after}))
    """)
    for name in ("shm", "gloo", "wtransfer:shm", "wtransfer:gloo"):
        assert name in got["engines"] and name in got["trainers"]
    assert got["backend"] == "wtransfer:shm" and got["same"]
    # Registering and looking the class up imports no engine module: only creation does.
    assert got["before"] == [] and got["after"] == []


def test_third_party_names_conflicts_and_broken_plugins(vllm_python: Path, third_party: Path) -> None:
    got = load(vllm_python, """
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        names = sorted(F._registry)
        example = F._registry["example"]()
        print(json.dumps({
            "names": names,
            "example_backend": example.wtransfer_backend,
            "example_imported": "wtransfer_example.engine" in sys.modules,
            "nccl_is_vllms": F._registry["nccl"]() is NCCLWeightTransferEngine,
            "ours_nccl": F._registry["wtransfer-nccl:nccl"]().wtransfer_backend,
        }))
    """, site=third_party)
    names = set(got["names"])
    # A pip-installed third-party engine: in vLLM with no registration call, module not imported.
    assert {"example", "wtransfer-example:example"} <= names
    assert got["example_backend"] == "wtransfer-example:example" and not got["example_imported"]
    # vLLM's own nccl stays vLLM's; wtransfer's is reachable by its qualified name.
    assert got["nccl_is_vllms"] and got["ours_nccl"] == "wtransfer-nccl:nccl"
    # Two providers of shm: the bare name is registered for neither, both qualified names are.
    assert "shm" not in names and {"wtransfer:shm", "acme-dup:shm"} <= names
    assert "gloo" in names  # everything else kept working despite acme's broken hook module
    assert "acme-dup:broken" in names  # listed from metadata; it fails only when created


def test_builtin_connectors_registered_lazily_in_vllms_kv_connector_factory(vllm_python: Path) -> None:
    got = load(vllm_python, """
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as K
        cls = K._registry["storage"]()      # what vLLM's get_connector_class looks up
        print(json.dumps({"names": sorted(K._registry), "cls": cls.__mro__[1].__name__,
                          "backend": cls.wtransfer_backend, "same": K._registry["wtransfer:storage"]() is cls,
                          "imported": sorted(m for m in sys.modules if m.startswith("wtransfer.connectors."))}))
    """)
    for name in ("storage", "multi", "offloading", "wtransfer:storage", "wtransfer:multi", "wtransfer:offloading"):
        assert name in got["names"]
    assert "ExampleConnector" in got["names"]  # vLLM's own are untouched
    assert got["cls"] == "WTransferKVConnectorAdapter" and got["backend"] == "wtransfer:storage" and got["same"]
    assert got["imported"] == []  # looking the class up imports no connector module


def test_unknown_backend_error_lists_wtransfer_names_with_did_you_mean(vllm_python: Path) -> None:
    got = load(vllm_python, """
        from vllm.config.weight_transfer import WeightTransferConfig
        errors = {}
        for name in ("shmm", "totally-unknown"):
            try:
                F.create_engine(WeightTransferConfig(backend=name), None, None, None)
            except ValueError as exc:
                errors[name] = str(exc)
        print(json.dumps(errors))
    """)
    assert "Did you mean 'shm'" in got["shmm"]
    for message in got.values():
        assert "wtransfer's engines" in message and "wtransfer:gloo" in message and "nccl" in message
    assert "Did you mean" not in got["totally-unknown"]


def test_unknown_connector_error_lists_wtransfer_names_with_did_you_mean(vllm_python: Path) -> None:
    got = load(vllm_python, """
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as K
        try:
            K.get_connector_class(KVTransferConfig(kv_connector="storag", kv_role="kv_both"))
        except ValueError as exc:
            print(json.dumps(str(exc)))
    """)
    assert "Invalid KV connector: 'storag'. Did you mean 'storage'" in got
    assert "ExampleConnector" in got and "wtransfer:multi" in got


def test_a_mistyped_name_fails_where_the_user_built_llm_before_any_engine_starts(
    vllm_python: Path, tiny_llama: Path
) -> None:
    """``LLM(...)`` with a backend or connector name nobody provides raises the bridge's
    did-you-mean in the user's process, as the last thing printed, typed as wtransfer's; vLLM
    alone would start an engine core and fail in its worker, under "See root cause above"."""
    code = """
import sys
from vllm import LLM
from vllm.config import KVTransferConfig
from wtransfer_vllm.testing import llm_kwargs
extra = ({"weight_transfer_config": {"backend": "shmm"}} if sys.argv[2] == "engine" else
         {"kv_transfer_config": KVTransferConfig(kv_connector="storag", kv_role="kv_both")})
try:
    LLM(**llm_kwargs(sys.argv[1], **extra))
except Exception as exc:
    import wtransfer
    print("caught as UnknownComponentError:", isinstance(exc, wtransfer.UnknownComponentError), file=sys.stderr)
    raise
"""
    for kind, expected in (("engine", "Invalid weight transfer backend: 'shmm'. Did you mean 'shm'"),
                           ("connector", "Invalid KV connector: 'storag'. Did you mean 'storage'")):
        done = run_script(vllm_python, "-c", code, str(tiny_llama), kind, timeout=300, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
        assert lines[-1].startswith(f"wtransfer_vllm.registration.UnknownVLLMBackendError: {expected}"), lines[-5:]
        assert "caught as UnknownComponentError: True" in lines
        assert "EngineCore" not in done.stdout + done.stderr, done.stderr[-3000:]  # no engine process started
    # vllm serve (as docs/vllm.md starts it): the same check, where it parses its arguments
    as_module = "import runpy; runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)"
    serve = run_script(vllm_python, "-c", as_module, "--model", str(tiny_llama),
                       "--host", "127.0.0.1", "--port", "1", "--block-size", "32",
                       "--weight-transfer-config", '{"backend": "shmm"}', timeout=300, check=False)
    lines = serve.stderr.strip().splitlines()
    assert serve.returncode == 1 and lines[-1].startswith(
        "wtransfer_vllm.registration.UnknownVLLMBackendError: Invalid weight transfer backend: 'shmm'"), lines[-5:]
    assert "EngineCore" not in serve.stdout + serve.stderr
