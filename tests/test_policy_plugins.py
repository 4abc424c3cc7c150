"""Eviction policies are the fourth plugin kind: entry points in ``wtransfer.policies``.

Every test uses real installed distributions (``fake_distribution`` writes a real
``.dist-info``; ``installed_example`` is the example plugin built and pip-installed), so
what is checked is the discovery path a user's ``pip install`` takes. Each test names
the broken implementation it is there to catch.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import wtransfer
from wtransfer import KVCacheSpec, KVTransferConfig, OffloadingSpecFactory
from wtransfer.specs.policies import ARCPolicy, LRUPolicy, create_policy, policy_class
from wtransfer.testing.processes import run_python

LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
GROUP = "wtransfer.policies"

MRU_SOURCE = '''
from wtransfer.specs import LRUPolicy

class MRUPolicy(LRUPolicy):
    """Most recently used goes first (observably unlike the built-ins)."""

    def evict(self, count, can_evict):
        victims = [key for key in reversed(self.order()) if can_evict(key)][:count]
        if len(victims) < count:
            return None
        for key in victims:
            self.remove(key)
        return victims
'''


def cpu_spec(policy: str, num_cpu_blocks: int = 2):
    """The built-in cpu spec with ``eviction_policy=policy``."""
    config = KVTransferConfig(
        "offloading", kv_connector_extra_config={"num_cpu_blocks": num_cpu_blocks, "eviction_policy": policy}
    )
    return OffloadingSpecFactory.create_spec(config, KVCacheSpec(LAYERS, 4, 2, 8, "float32", "test-model"))


def evicted_after_abc(manager) -> tuple:
    """Store a, b; touch a; store c into a 2-block tier: which block left says which policy ran."""
    for key in ("a", "b"):
        out = manager.prepare_store([key])
        manager.complete_store(out.block_hashes_to_store)
    manager.touch(["a"])
    out = manager.prepare_store(["c"])
    return out.block_hashes_evicted


# -- listing -------------------------------------------------------------------------------------


def test_cli_lists_builtin_policies_as_entry_points():
    """Catches: the built-ins not declared in pyproject.toml, or ``policies`` missing from the CLI's kinds."""
    as_json = run_python("from wtransfer.cli import main; raise SystemExit(main(['list', 'policies', '--json']))")
    rows = {row["name"]: row for row in json.loads(as_json.stdout)}
    assert set(rows) >= {"lru", "arc"}
    assert rows["lru"] == {"kind": "policies", "name": "lru", "distribution": "wtransfer",
                           "version": wtransfer.__version__, "target": "wtransfer.specs.policies:LRUPolicy",
                           "status": "available"}
    assert rows["arc"]["target"] == "wtransfer.specs.policies:ARCPolicy"
    table = run_python("from wtransfer.cli import main; raise SystemExit(main(['list', 'policy']))")
    assert "lru" in table.stdout and "arc" in table.stdout and "policies" in table.stdout
    everything = run_python("from wtransfer.cli import main; raise SystemExit(main(['list', '--json']))")
    assert {"lru", "arc"} <= {r["name"] for r in json.loads(everything.stdout) if r["kind"] == "policies"}


def test_pip_installed_example_ships_its_policy_as_an_entry_point(installed_example: Path):
    """Catches: the example still naming its policy by ``module:Class`` (that would warn) or not
    declaring it; a fresh interpreter must find ``fifo`` by bare and qualified name."""
    listed = run_python("from wtransfer.cli import main; raise SystemExit(main(['list', 'policies', '--json']))",
                        path=[installed_example])
    fifo = [r for r in json.loads(listed.stdout) if r["name"] == "fifo"]
    assert fifo == [{"kind": "policies", "name": "fifo", "distribution": "wtransfer-example", "version": "0.2.0",
                     "target": "wtransfer_example.fifo:FIFOPolicy", "status": "available"}]
    out = run_python(
        """
        import json, warnings
        warnings.simplefilter("error", DeprecationWarning)
        from wtransfer import KVCacheSpec, KVTransferConfig, OffloadingSpecFactory
        kv = KVCacheSpec(("l0",), 4, 2, 8, "float32", "m")
        names = {}
        for extra in ({"spec_name": "example-fifo"}, {"eviction_policy": "wtransfer-example:fifo"}):
            config = KVTransferConfig("offloading", kv_connector_extra_config={"num_cpu_blocks": 2, **extra})
            policy = OffloadingSpecFactory.create_spec(config, kv).get_manager().policy
            names[json.dumps(extra)] = type(policy).__module__ + ":" + type(policy).__name__
        print(json.dumps(names))
        """,
        path=[installed_example],
    )
    assert set(json.loads(out.stdout).values()) == {"wtransfer_example.fifo:FIFOPolicy"}


# -- resolution through the registry -------------------------------------------------------------


def test_installed_policy_is_used_by_the_cpu_spec_by_bare_and_qualified_name(fake_distribution, tmp_path: Path):
    """Catches: ``policy_class`` keeping its own dict (an installed entry point would be unknown), and
    importing a policy just to list it."""
    marker = tmp_path / "imported.txt"
    fake_distribution("acme-mru", {GROUP: {"mru": "acme_mru.policy:MRUPolicy"}},
                      {"acme_mru.policy": f"open({str(marker)!r}, 'a').write('imported')\n" + MRU_SOURCE}, "1.2")
    listed = {i.name: i for i in wtransfer.list_components("policies")}
    assert listed["mru"].distribution == "acme-mru" and listed["mru"].version == "1.2"
    assert not marker.exists(), "listing imported the policy module"
    for name in ("mru", "acme-mru:mru", "Acme_MRU:mru"):
        spec = cpu_spec(name)
        policy = spec.get_manager().policy
        assert type(policy).__module__ == "acme_mru.policy" and type(policy).__name__ == "MRUPolicy"
        assert evicted_after_abc(spec.get_manager()) == ("a",)  # LRU would evict "b"
    assert evicted_after_abc(cpu_spec("lru").get_manager()) == ("b",)
    assert marker.read_text() == "imported", "the policy module must be imported exactly once"


def test_same_policy_name_in_two_distributions_is_ambiguous(fake_distribution):
    """Catches: a silent winner (first entry point, or last registration) for a bare name."""
    fake_distribution("acme-one", {GROUP: {"twin": "acme_one.policy:MRUPolicy"}}, {"acme_one.policy": MRU_SOURCE})
    fake_distribution("acme-two", {GROUP: {"twin": "acme_two.policy:MRUPolicy"}}, {"acme_two.policy": MRU_SOURCE},
                      "2.0")
    with pytest.raises(wtransfer.AmbiguousComponentError) as info:
        cpu_spec("twin")
    for fragment in ("'acme-one:twin'", "'acme-two:twin'", "acme-two 2.0"):
        assert fragment in str(info.value)
    assert policy_class("acme-one:twin").__module__ == "acme_one.policy"
    assert policy_class("acme-two:twin").__module__ == "acme_two.policy"
    statuses = {i.distribution: i.status for i in wtransfer.list_components("policies") if i.name == "twin"}
    assert statuses == {"acme-one": "conflict", "acme-two": "conflict"}


def test_unknown_policy_suggests_and_lists(fake_distribution):
    """Catches: an ad-hoc error without did-you-mean, or one that does not list installed policies."""
    fake_distribution("acme-mru", {GROUP: {"mru": "acme_mru.policy:MRUPolicy"}}, {"acme_mru.policy": MRU_SOURCE})
    with pytest.raises(wtransfer.UnknownComponentError, match=r"Unknown policy 'mur'\. Did you mean 'mru'\?") as info:
        cpu_spec("mur")
    assert "Available policies: arc, lru, mru" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(wtransfer.UnknownComponentError, match="Did you mean 'arc'") as info:
        policy_class("acme-mru:arc")  # qualified by the wrong distribution: never falls back to the built-in
    assert "module:Class" not in str(info.value), "a distribution:name must not be tried as a module path"


def test_a_non_policy_class_in_the_entry_point_is_rejected(fake_distribution):
    """Catches: instantiating whatever the entry point names (it would break at the first eviction)."""
    fake_distribution("acme-wrong", {GROUP: {"wrong": "acme_wrong.policy:NotAPolicy"}},
                      {"acme_wrong.policy": "class NotAPolicy:\n    def __init__(self, capacity): pass\n"}, "0.4")
    with pytest.raises(wtransfer.InvalidComponentError, match="not a subclass of .*EvictionPolicy") as info:
        cpu_spec("wrong")
    for fragment in ("acme-wrong", "0.4", "acme_wrong.policy:NotAPolicy"):
        assert fragment in str(info.value)
    assert isinstance(cpu_spec("arc").get_manager().policy, ARCPolicy), "other policies keep working"


def test_policies_can_be_disabled_like_any_component(fake_distribution, monkeypatch: pytest.MonkeyPatch):
    """Catches: the kind missing from ``WTRANSFER_DISABLE_PLUGINS`` parsing (``policy:NAME``)."""
    fake_distribution("acme-mru", {GROUP: {"mru": "acme_mru.policy:MRUPolicy"}}, {"acme_mru.policy": MRU_SOURCE})
    monkeypatch.setenv("WTRANSFER_DISABLE_PLUGINS", "policy:mru")
    wtransfer.refresh()
    with pytest.raises(wtransfer.DisabledComponentError, match="WTRANSFER_DISABLE_PLUGINS"):
        cpu_spec("mru")
    assert {i.name: i.status for i in wtransfer.list_components("policies")}["mru"] == "disabled"


# -- the 0.1 shims are gone, and say what replaced them -------------------------------------------


def test_the_removed_shims_say_what_replaced_them():
    """Catches: an old config's ``module:Class`` policy silently imported (two ways to name a policy),
    or failing without naming the entry-point group; and the hint shown for ``distribution:name``."""
    with pytest.raises(wtransfer.UnknownComponentError, match=r"looks like a 'module:Class' path.*entry-points\."):
        cpu_spec("wtransfer.specs.policies:ARCPolicy")
    with pytest.raises(wtransfer.UnknownComponentError) as info:
        policy_class("acme:fifo")
    assert "module:Class" not in str(info.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert isinstance(create_policy("wtransfer:lru", 2), LRUPolicy)
        assert isinstance(create_policy("arc", 2), ARCPolicy)
    with pytest.raises(ImportError, match="cannot import name 'register_policy'"):
        from wtransfer import register_policy  # noqa: F401

