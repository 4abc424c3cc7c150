"""The bridge's reaches into vLLM internals: all in ``wtransfer_vllm.vllm_internals``, all still there.

* In the real vLLM (its own interpreter): every object and attribute ``INTERNALS`` names exists
  and has the expected kind; a test per internal, named after it (``WeightTransferEngineFactory._registry``),
  so a vLLM release that changes one fails by that name.
* Without vLLM: no other module of the bridge touches vLLM privately (``ast`` over the sources).
"""

from __future__ import annotations

import ast
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from vllm_harness import PLUGIN_ROOT, run_script
from wtransfer_vllm.probe import PROBED_METHODS
from wtransfer_vllm.vllm_internals import INTERNALS, Internal

PACKAGE = PLUGIN_ROOT / "wtransfer_vllm"
ISOLATED = "vllm_internals.py"
KINDS = {"dict", "classmethod", "method", "instance", "function"}
NOT_VLLM = {"_parameters": "torch.nn.Module's own parameters (torch, not vLLM)",
            "_buffers": "torch.nn.Module's own buffers (torch, not vLLM)",
            "_iter_named_params": "TRL's VLLMGeneration walk of the trainer's parameters (TRL, not vLLM)"}
"""Private names the bridge reads that belong to other libraries (each checked by hand)."""
LISTED = frozenset(internal.attribute for internal in INTERNALS)
"""The attributes ``INTERNALS`` lists: outside ``vllm_internals`` none may be used (load, store,
``del``, a ``getattr``-family string, an import from vLLM), whatever the object, but for ALLOWED."""
ALLOWED: dict[tuple[str, str], str] = {
    # A use of a LISTED attribute name (module, "receiver.attribute" exactly as written) that is
    # not the internal the row names. Each checked by hand; an entry no module uses fails a test.
    # -- vllm.LLM's public methods (the bridge's public API, see vllm_internals' docstring), not
    #    EngineCore.collective_rpc / EngineCore.reset_prefix_cache / the Worker's methods:
    ("bench.py", "llm.collective_rpc"): "vllm.LLM.collective_rpc('reload_weights', ...): the baseline benchmark",
    ("testing.py", "llm.collective_rpc"): "vllm.LLM.collective_rpc('compute_weight_checksums')",
    ("bench_kv.py", "llm.reset_prefix_cache"): "vllm.LLM.reset_prefix_cache() between timed runs",
    ("bench.py", "llm.reset_prefix_cache"): "vllm.LLM.reset_prefix_cache() after TRL's per-tensor load, as TRL does",
    **{("client.py", f"self.llm.{name}"): f"vllm.LLM.{name}: LLMClient adapts the offline LLM's weight-sync "
       f"methods (self.llm is the user's vllm.LLM)" for name in
       ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")},
    # -- the field of vLLM's public config / plugin dataclasses, not Worker.rank:
    ("engine.py", "parallel.rank"): "ParallelConfig.rank (parallel = vllm_config.parallel_config, handed to the "
                                    "engine's __init__ by vLLM)",
    ("connector.py", "parallel.rank"): "ParallelConfig.rank, read with getattr(parallel, 'rank', 0) from "
                                       "vllm_config.parallel_config when the TP group is not up",
    ("trainer.py", "init_info.rank"): "TrainerInitInfo.rank, the documented keyword field of vLLM's trainer "
                                      "init info (the bridge's WTransferTrainerInitInfo subclasses it)",
    # -- vLLM's public outputs, not EngineCoreOutput.stop_reason:
    ("testing.py", "o.outputs[0].stop_reason"): "CompletionOutput.stop_reason of LLM.generate's RequestOutput",
    # -- the KV connector interface's arguments (vLLM hands the connector its Request), not the salting:
    ("connector.py", "request.cache_salt"): "the cache salt of the Request vLLM passes to the KV connector's "
                                            "get_num_new_matched_tokens: it keys the KV the connector stores",
    # -- wtransfer's own objects, not vLLM's:
    ("connector.py", "wtransfer.block_hashes"): "wtransfer's block_hashes function (import wtransfer)",
    ("engine.py", "wtransfer.WeightTransferEngineFactory.create_engine"): "wtransfer's factory (import wtransfer)",
    ("engine.py", "self.inner.start_weight_update"): "self.inner is the wtransfer engine the adapter created",
    ("engine.py", "self.inner.finish_weight_update"): "self.inner is the wtransfer engine the adapter created",
}
"""Uses of a LISTED name in a bridge module that are not a reach into vLLM (see the comments)."""


# ================================================================ in the real vLLM
@pytest.fixture(scope="module")
def vllm_report(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str | None]]:
    """One interpreter of the vLLM environment checks every internal (importing vLLM once)."""
    out = tmp_path_factory.mktemp("internals") / "report.json"
    run_script(vllm_python, "check_internals.py", str(out), timeout=300)
    return [tuple(row) for row in json.loads(out.read_text())]


@pytest.mark.parametrize(("index", "internal"), list(enumerate(INTERNALS)), ids=[i.name for i in INTERNALS])
def test_vllm_still_has(index: int, internal: Internal, vllm_report: list[tuple[str, str | None]]) -> None:
    name, problem = vllm_report[index]
    assert name == internal.name, "INTERNALS changed while it was being checked"
    assert problem is None, (
        f"vLLM changed {internal.path}.{internal.attribute} ({internal.kind}): {problem}. wtransfer-vllm relies "
        f"on it for: {internal.use} (see wtransfer_vllm/vllm_internals.py)"
    )


# ================================================================ the table itself (no vLLM)
def test_internals_table_is_well_formed() -> None:
    names = [internal.name for internal in INTERNALS]
    assert len(names) == len(set(names)), "two rows share a test id"
    for internal in INTERNALS:
        assert internal.path.startswith("vllm.") and internal.attribute and internal.use, internal
        assert internal.kind in KINDS, internal
        assert not internal.params or internal.kind in {"classmethod", "method", "function"}, internal


def test_the_probes_layer_classes_are_listed() -> None:
    """The probe recognises vLLM's quantization methods by class name: a rename must fail here too."""
    listed = {internal.path.rsplit(".", 1)[1] for internal in INTERNALS}
    assert set(PROBED_METHODS) <= listed


def test_without_vllms_mtp_check_the_load_runs_and_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A vLLM without ``disable_mtp_completeness_check``: a no-op context, and one warning per process."""
    from wtransfer_vllm import vllm_internals

    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.mtp_validation", None)  # import fails
    monkeypatch.setattr(vllm_internals, "_mtp_fallback_warned", False)
    with caplog.at_level(logging.WARNING, logger="vllm.wtransfer_vllm"):
        for _ in range(3):
            with vllm_internals.disable_mtp_completeness_check():
                pass
    warnings = [r for r in caplog.records if "disable_mtp_completeness_check" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


# ================================================================ nothing else reaches in (no vLLM)
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.Assign, ast.Delete)):
        found = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        found = [node.target]
    else:
        return []
    return [item for target in found for item in (target.elts if isinstance(target, ast.Tuple) else [target])]


def own_private_names(sources: list[str]) -> set[str]:
    """Private names the bridge defines itself: its functions, classes, module and class
    attributes, and what it assigns on ``self`` / ``cls``."""
    own: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                own.add(node.name)
            for target in _targets(node):
                if isinstance(target, ast.Name) and _private(target.id):
                    own.add(target.id)
                elif (isinstance(target, ast.Attribute) and _private(target.attr) and isinstance(target.value, ast.Name)
                      and target.value.id in ("self", "cls")):
                    own.add(target.attr)
    return own


def _listed_use(module: str, receiver: ast.AST, attribute: str, allowed: Mapping[tuple[str, str], str],
                 used: set[tuple[str, str]]) -> bool:
    """Whether ``receiver.attribute`` uses a LISTED name and is not in ``allowed`` (noting those that are)."""
    if attribute not in LISTED:
        return False
    key = (module, f"{ast.unparse(receiver)}.{attribute}")
    if key in allowed:
        used.add(key)
        return False
    return True


def vllm_reaches(source: str, own: set[str] = frozenset(), module: str = "<snippet>",
                 allowed: Mapping[tuple[str, str], str] = ALLOWED, used: set[tuple[str, str]] | None = None) -> list[str]:
    """Every place ``source`` reaches into vLLM privately (line: what), as far as ``ast`` can tell.

    Flagged: ``._registry`` on anything; importing an underscore name or module from ``vllm``;
    a private attribute, an attribute assignment (any target: ``=``, ``+=``, ``for``, ``with``)
    or ``del`` on a name imported from ``vllm`` (or a plain alias of one, ``E = core.EngineCore``);
    any ``setattr``/``delattr`` (monkeypatching); any private attribute or ``getattr``-family
    string the bridge does not define itself (``own``), such as one inherited from a vLLM base
    class (``self._kv_transfer_config``) or one of an object vLLM handed over (``worker._flag``);
    and any use of an attribute name ``INTERNALS`` lists (LISTED), public-looking or not, on any
    object (``layer.quant_method``, ``core.scheduler.running``, ``getattr(m, "quant_method")``,
    ``m.process_weights_after_loading = f``, ``from vllm... import disable_mtp_completeness_check``),
    unless ``(module, "receiver.attribute")`` is in ``allowed`` (those found there are added to ``used``).
    """
    tree = ast.parse(source)
    found: list[str] = []
    used = set() if used is None else used
    vllm_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    vllm_names.add(alias.asname or alias.name.split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: imports vLLM's private module {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and _is_vllm(node.module):
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{node.lineno}: imports from vLLM's private module {node.module}")
            for alias in node.names:
                vllm_names.add(alias.asname or alias.name)
                if _private(alias.name):
                    found.append(f"{node.lineno}: imports vLLM's private {node.module}.{alias.name}")
                elif alias.name in LISTED:
                    found.append(f"{node.lineno}: imports {node.module}.{alias.name}, listed in INTERNALS "
                                 f"(use {ISOLATED})")
    aliased = True
    while aliased:  # plain aliases of vLLM names (E = EngineCore, E = core.EngineCore), to a fixed point
        aliased = False
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute))
                    and _root(node.value) in vllm_names):
                for target in _targets(node):
                    if isinstance(target, ast.Name) and target.id not in vllm_names:
                        vllm_names.add(target.id)
                        aliased = True
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr == "_registry":
                found.append(f"{node.lineno}: reads a vLLM factory's ._registry")
            elif _root(node) in vllm_names:
                found.append(f"{node.lineno}: private attribute {node.attr} of vLLM's {_root(node)}")
            elif node.attr not in own and node.attr not in NOT_VLLM:
                found.append(f"{node.lineno}: private attribute .{node.attr}, not the bridge's own")
        if isinstance(node, ast.Attribute):
            if _listed_use(module, node.value, node.attr, allowed, used):
                found.append(f"{node.lineno}: {ast.unparse(node)}: .{node.attr} is listed in INTERNALS (use {ISOLATED})")
            if isinstance(node.ctx, (ast.Store, ast.Del)) and _root(node) in vllm_names:
                found.append(f"{node.lineno}: assigns or deletes vLLM's {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name in ("setattr", "delattr"):
                found.append(f"{node.lineno}: {name}() (patching belongs in {ISOLATED})")
            if name in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
                key = node.args[1]
                if (isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value)
                        and key.value not in own and key.value not in NOT_VLLM):
                    found.append(f"{node.lineno}: {name}(..., {key.value!r}), not the bridge's own")
                if (isinstance(key, ast.Constant) and isinstance(key.value, str)
                        and _listed_use(module, node.args[0], key.value, allowed, used)):
                    found.append(f"{node.lineno}: {name}(..., {key.value!r}): listed in INTERNALS (use {ISOLATED})")
        for target in _targets(node):
            if isinstance(node, ast.Delete) and isinstance(target, ast.Attribute) and _root(target) not in ("self", "cls"):
                found.append(f"{node.lineno}: deletes .{target.attr} of an object the bridge did not make (patching "
                             f"belongs in {ISOLATED})")
    return sorted(set(found), key=lambda text: int(text.split(":")[0]))


def _modules() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(PACKAGE.glob("*.py"))}


def test_no_module_but_vllm_internals_reaches_into_vllm() -> None:
    modules = _modules()
    assert ISOLATED in modules
    own = own_private_names(list(modules.values()))
    used: set[tuple[str, str]] = set()
    reaches = {name: vllm_reaches(source, own, name, ALLOWED, used) for name, source in modules.items()
               if name != ISOLATED}
    assert {name: found for name, found in reaches.items() if found} == {}, (
        f"move these into wtransfer_vllm/{ISOLATED} (with a row in INTERNALS)"
    )
    assert set(ALLOWED) - used == set(), "ALLOWED entries no bridge module uses any more: remove them"


def test_an_allowed_use_is_allowed_only_in_its_module() -> None:
    assert vllm_reaches("def f(parallel):\n    return parallel.rank", module="engine.py") == []
    assert vllm_reaches("def f(parallel):\n    return parallel.rank", module="worker_rpc.py")
    assert vllm_reaches("def f(worker):\n    return worker.rank", module="engine.py")


@pytest.mark.parametrize("snippet", [
    "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\nnames = set(F._registry)",
    "def names(factory):\n    return set(factory._registry)",
    "def names(factory):\n    return getattr(factory, '_registry', {})",
    "from vllm.model_executor.layers import _custom_thing",
    "import vllm._custom_ops as ops",
    "from vllm._custom_ops import something",
    "from vllm.v1.engine.core import EngineCore\nEngineCore.collective_rpc = lambda *a: None",
    "from vllm.v1.engine import core\ndel core.EngineCore.collective_rpc",
    "def restore(method):\n    del method.process_weights_after_loading",
    "def patch(factory, wrapped):\n    setattr(factory, 'create_engine', classmethod(wrapped))",
    "def end(worker):\n    worker._weight_update_active = False",
    "def module_of(source):\n    return getattr(source, '_module', None)",
    "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
    "class C(KVConnectorBase_V1):\n    def f(self):\n        return self._kv_transfer_config",
    # public-looking names INTERNALS lists, on objects vLLM handed over
    "def method_of(layer):\n    return getattr(layer, \"quant_method\")",
    "def method_of(layer):\n    return layer.quant_method",
    "def patch(method, f):\n    method.process_weights_after_loading = f",
    "def running(core):\n    return len(core.scheduler.running)",
    "def engine_of(worker):\n    return hasattr(worker, 'weight_transfer_engine')",
    "from vllm.v1.engine.core import EngineCore\nclass C(EngineCore):\n    def f(self):\n        return self.vllm_config",
    "from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check",
    # plain attribute assignment onto vLLM names, whatever the name and the statement
    "from vllm.config import VllmConfig\nVllmConfig.anything = None",
    "from vllm.v1.engine import core\ncore.EngineCore.step += 1",
    "from vllm.v1.engine.core import EngineCore\nE = EngineCore\nE.step = None",
    "import vllm\nfor vllm.envs.VLLM_FLAG in (1,):\n    pass",
], ids=["registry-on-vllm-name", "registry-anywhere", "registry-by-getattr", "private-name-import",
        "private-module-import", "private-module-from-import", "classmethod-replaced", "del-on-vllm", "del-on-handed-object",
        "setattr", "private-attribute-of-handed-object", "private-getattr-string", "inherited-private",
        "listed-getattr-string", "listed-attribute", "listed-attribute-assigned", "listed-chain", "listed-hasattr-string",
        "listed-inherited", "listed-function-import", "assign-on-vllm-name", "augassign-on-vllm-name",
        "assign-on-vllm-alias", "for-target-on-vllm-name"])
def test_the_source_check_finds_reaches(snippet: str) -> None:
    assert vllm_reaches(snippet), snippet


def test_the_listed_rules_alone_find_the_public_looking_reaches() -> None:
    """The new rules, each on its own: none of these is private, and none uses setattr/del."""
    for snippet, expected in [
        ("def f(layer):\n    return getattr(layer, 'quant_method')", "'quant_method'"),
        ("def f(layer):\n    return layer.quant_method", "layer.quant_method"),
        ("def f(method, g):\n    method.process_weights_after_loading = g", "method.process_weights_after_loading"),
        ("def f(core):\n    return core.scheduler.running", "core.scheduler.running"),
        ("from vllm.config import VllmConfig\nVllmConfig.anything = None", "VllmConfig.anything"),
    ]:
        found = vllm_reaches(snippet)
        assert len(found) >= 1 and any(expected in line for line in found), (snippet, found)


def test_the_source_check_leaves_the_bridges_own_names_alone() -> None:
    snippet = (
        "import vllm\nfrom vllm.config import KVTransferConfig\n"
        "class A:\n    _cache = {}\n    def __init__(self):\n        self._x = 1\n"
        "    def f(self, module):\n        return self._x, A._cache, type(self).__name__, module._parameters, "
        "KVTransferConfig.__name__, getattr(module, '_parameters')\n"
    )
    assert vllm_reaches(snippet, own_private_names([snippet])) == []


def test_the_source_check_flags_the_bridge_as_it_was() -> None:
    """The bridge's modules as they were before ``vllm_internals`` existed: every reach is found."""
    before = {
        "registration": "def _existing_names(factory):\n    return set(getattr(factory, '_registry', {}) or {})\n"
                        "def _explain(factory, method, wrapped):\n    setattr(factory, method, classmethod(wrapped))",
        "engine_core": "def install():\n    from vllm.v1.engine.core import EngineCore\n"
                       "    EngineCore.collective_rpc = collective_rpc",
        "worker_rpc": "def _end_session(worker):\n    if getattr(worker, '_weight_update_active', False):\n"
                      "        worker._weight_update_active = False",
        "trainer": "def _as_source(source):\n    return getattr(source, '_module', None)",
        "connector": "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
                     "class A(KVConnectorBase_V1):\n    def __init__(self):\n        transfer = self._kv_transfer_config",
        "engine (mtp)": "def load_into_model(model, weights):\n    try:\n        from vllm.model_executor.model_loader."
                        "mtp_validation import disable_mtp_completeness_check\n    except ImportError:\n        pass",
        "engine (tied)": "def refresh(method, module):\n    if hasattr(method, 'process_weights_after_loading'):\n"
                         "        method.process_weights_after_loading(module)",
    }
    for module, source in before.items():
        assert vllm_reaches(source, own_private_names([source])), module


def test_only_layers_no_round_fills_have_their_load_warning_taken() -> None:
    """vLLM warns ``"<Layer>: Failed to load weights"`` for every layer a load gave nothing. Rotary caches (buffers
    only) and tied heads never get a tensor; any other class must still show, since a round carries every tensor."""
    import torch

    from wtransfer_vllm.vllm_internals import layers_left_as_they_were

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4))

    class Head(torch.nn.Module):
        def __init__(self, weight: torch.nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4)
    model.rotary = Rotary()
    model.proj = torch.nn.Linear(4, 4)
    model.head = Head(model.embed.weight)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    handler = Keep()
    layerwise.addHandler(handler)
    try:
        with layers_left_as_they_were(model) as left:
            for layer in ("Rotary", "Head", "Linear"):
                layerwise.warning("%s: Failed to load weights", layer)
    finally:
        layerwise.removeHandler(handler)
    assert left == ["Rotary", "Head"]
    assert seen == ["Linear: Failed to load weights"]
