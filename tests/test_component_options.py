"""Typed options of KV connectors and offloading specs: declared once, parsed once, clear errors.

Each test names (in a comment) the broken implementation it exists to catch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wtransfer import KVCacheSpec, KVConnectorFactory, KVConnectorRole, KVTransferConfig, OffloadingSpecFactory
from wtransfer.connectors._base import KVConnectorBase, KVConnectorMetadata
from wtransfer.connectors.multi import MultiConnector, MultiOptions
from wtransfer.connectors.offloading import OffloadingConnector, OffloadingConnectorOptions
from wtransfer.connectors.storage import StorageConnector, StorageOptions
from wtransfer.errors import InvalidOptionError
from wtransfer.options import describe_options, option
from wtransfer.specs._base import OffloadingSpec, OffloadingSpecOptions
from wtransfer.specs.cpu import CPU_SPEC_OPTIONS, CPUOffloadingSpec, CPUSpecOptions

SPEC = KVCacheSpec(("layer.0", "layer.1"), 4, 2, 8, "float32", "options-test")
ROLES = [KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER]


def _connector(name: str, role: KVConnectorRole = KVConnectorRole.WORKER, **extra: Any) -> KVConnectorBase:
    return KVConnectorFactory.create_connector(KVTransferConfig(name, kv_connector_extra_config=extra), role, SPEC)


def _storage(tmp_path: Path, role: KVConnectorRole = KVConnectorRole.WORKER, **extra: Any) -> KVConnectorBase:
    return _connector("storage", role, path=str(tmp_path / "kv"), **extra)


# ------------------------------------------------------------------------------------------ storage
@pytest.mark.parametrize("role", ROLES)
def test_storage_wrong_type_names_the_option_and_the_expected_type(tmp_path: Path, role: KVConnectorRole) -> None:
    # catches: int(options["io_threads"]) ("invalid literal for int()", option not named)
    with pytest.raises(InvalidOptionError) as raised:
        _storage(tmp_path, role, io_threads="two")
    assert str(raised.value) == (
        "storage connector: option 'io_threads' in kv_connector_extra_config must be int, got 'two' (str)"
    )
    assert isinstance(raised.value, ValueError)  # callers that catch ValueError keep working


def test_storage_bool_option_is_not_truthiness(tmp_path: Path) -> None:
    # catches: bool(options["fsync"]), which turns the string "false" into True
    with pytest.raises(InvalidOptionError, match=re.escape("option 'fsync' in kv_connector_extra_config must be bool")):
        _storage(tmp_path, fsync="false")


def test_storage_unknown_key_suggests_the_close_one_and_lists_the_valid_ones(tmp_path: Path) -> None:
    # catches: the old hand-made check (a sorted list, no "did you mean")
    with pytest.raises(InvalidOptionError) as raised:
        _storage(tmp_path, io_thread=2)
    assert str(raised.value) == (
        "storage connector: unknown option(s) 'io_thread' (did you mean 'io_threads'?) in "
        "kv_connector_extra_config; valid options: capacity_bytes, fsync, io_threads, io_timeout_s, max_pending_save_bytes, path"
    )


def test_storage_reads_the_parsed_options_in_both_roles(tmp_path: Path) -> None:
    # catches: a connector that declares options_cls but keeps reading (and casting) the raw dict,
    # or a base class that parses only for one role
    for role in ROLES:
        connector = _storage(tmp_path, role, io_threads=3, fsync=True, io_timeout_s=5)
        try:
            assert connector.options == StorageOptions(str(tmp_path / "kv"), 3, True, 5.0)
            assert (connector.io_threads, connector.fsync, connector.io_timeout_s) == (3, True, 5.0)
            assert isinstance(connector.io_timeout_s, float)
        finally:
            connector.shutdown()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"path": "/unused", "io_threads": 0},
         "storage connector: io_threads must be >= 1, got 0 (in kv_connector_extra_config)"),
        ({"path": ""}, "storage connector: option 'path' must name a directory, got ''"),
    ],
)
def test_storage_range_checks_still_apply(extra: dict[str, Any], message: str) -> None:
    # catches: dropping the checks that used to follow the int() casts (and the empty-path check)
    with pytest.raises(InvalidOptionError, match=re.escape(message)):
        _connector("storage", **extra)


# -------------------------------------------------------------------------------------------- multi
def test_multi_wrong_top_level_key_is_unknown_with_a_hint(tmp_path: Path) -> None:
    # catches: checking "connectors" is present before checking for unknown keys ("needs
    # 'connectors'" for what is a typo), and the old message without a hint
    with pytest.raises(InvalidOptionError) as raised:
        _connector("multi", connector=[{"kv_connector": "storage", "kv_connector_extra_config": {"path": "x"}}])
    assert str(raised.value) == (
        "multi connector: unknown option(s) 'connector' (did you mean 'connectors'?) in "
        "kv_connector_extra_config; valid options: connectors"
    )


def test_multi_extra_top_level_key_next_to_connectors_is_refused(tmp_path: Path) -> None:
    # catches: a multi connector that reads "connectors" and ignores everything else
    child = {"kv_connector": "storage", "kv_connector_extra_config": {"path": str(tmp_path)}}
    unknown = "multi connector: unknown option(s) 'fallback' in kv_connector_extra_config; valid options: connectors"
    with pytest.raises(InvalidOptionError, match=re.escape(unknown)):
        _connector("multi", connectors=[child], fallback=True)


@pytest.mark.parametrize(
    ("connectors", "message"),
    [
        ({"kv_connector": "storage"}, "option 'connectors' in kv_connector_extra_config must be list"),
        ([], "option 'connectors' must list at least one child connector config"),
    ],
)
def test_multi_connectors_must_be_a_non_empty_list(connectors: Any, message: str) -> None:
    # catches: iterating a dict's keys as children, or a multi connector with no child at all
    with pytest.raises(InvalidOptionError, match=re.escape(message)):
        _connector("multi", connectors=connectors)


def test_multi_children_check_their_own_options(tmp_path: Path) -> None:
    # catches: a parent that swallows (or re-checks against its own table) its children's options
    child = {"kv_connector": "storage", "kv_connector_extra_config": {"path": str(tmp_path), "io_thread": 1}}
    with pytest.raises(InvalidOptionError, match=re.escape("storage connector: unknown option(s) 'io_thread'")):
        _connector("multi", connectors=[child])


# --------------------------------------------------------------------------------------- offloading
@pytest.mark.parametrize("role", ROLES)
def test_offloading_misspelled_size_is_an_unknown_key_not_a_missing_size(role: KVConnectorRole) -> None:
    # catches: the connector checking the whole dict against its own two keys (the hint and the
    # valid keys would be the connector's, num_cpu_blocks missing), and a spec that ignores
    # unknown keys (the error would be "needs a size")
    with pytest.raises(InvalidOptionError) as raised:
        _connector("offloading", role, spec_name="cpu", num_cpu_block=8)
    assert str(raised.value) == (
        "cpu offloading spec: unknown option(s) 'num_cpu_block' (did you mean 'num_cpu_blocks'?) in "
        "kv_connector_extra_config; valid options: block_size, cpu_bytes_to_use, eviction_policy, "
        "num_cpu_blocks, spec_module_path, spec_name, staging_blocks, transfer_timeout_s"
    )


def test_offloading_connector_checks_its_own_keys() -> None:
    # catches: an offloading connector that declares nothing, so a non-string spec_name reaches the registry
    with pytest.raises(InvalidOptionError, match=re.escape(
        "offloading connector: option 'spec_name' in kv_connector_extra_config must be str, got 3 (int)"
    )):
        _connector("offloading", KVConnectorRole.SCHEDULER, spec_name=3, num_cpu_blocks=4)


def test_offloading_connector_and_cpu_spec_read_parsed_options() -> None:
    # catches: the spec still casting the raw dict (a float timeout given as an int, bytes as 8e3)
    connector = _connector(
        "offloading", KVConnectorRole.SCHEDULER, cpu_bytes_to_use=8e3, transfer_timeout_s=5, block_size=8
    )
    assert isinstance(connector, OffloadingConnector)
    assert connector.options == OffloadingConnectorOptions()
    spec = connector.spec
    assert isinstance(spec, CPUOffloadingSpec) and isinstance(spec.options, CPUSpecOptions)
    assert spec.timeout_s == 5.0 and isinstance(spec.timeout_s, float)
    assert spec.offloaded_block_size == 8 and spec.num_blocks == 8000 // spec.bytes_per_block
    connector.shutdown()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_cpu_blocks": "4"}, "cpu offloading spec: option 'num_cpu_blocks' in kv_connector_extra_config "
                                  "must be int or None, got '4' (str)"),
        ({"num_cpu_blocks": 4, "staging_blocks": 2.5}, "option 'staging_blocks' in kv_connector_extra_config "
                                                        "must be int"),
        ({"num_cpu_blocks": 4, "eviction_policy": 1}, "option 'eviction_policy' in kv_connector_extra_config "
                                                       "must be str"),
        ({"num_cpu_blocks": 4, "block_size": 0}, "kv_connector_extra_config['block_size'] must be > 0, got 0"),
    ],
)
def test_cpu_spec_wrong_types_name_the_option(extra: dict[str, Any], message: str) -> None:
    # catches: int()/str() casts that accept or mangle what the user wrote
    with pytest.raises(InvalidOptionError, match=re.escape(message)):
        OffloadingSpecFactory.create_spec(KVTransferConfig("offloading", kv_connector_extra_config=extra), SPEC)


# ------------------------------------------------------------------------ declared once, documented
@pytest.mark.parametrize(
    ("component", "options_cls"),
    [
        (StorageConnector, StorageOptions),
        (MultiConnector, MultiOptions),
        (OffloadingConnector, OffloadingConnectorOptions),
        (CPUOffloadingSpec, CPUSpecOptions),
    ],
)
def test_every_built_in_declares_documented_options(component: type, options_cls: type) -> None:
    # catches: a built-in left undeclared (its dict silently unchecked) or an option without a doc
    assert component.options_cls is options_cls
    rows = describe_options(options_cls)
    assert rows and all(row["doc"] for row in rows), rows
    assert component.options_owner


def test_tables_match_what_users_could_write() -> None:
    # catches: the cpu table drifting from the keys the factory and the base class read
    assert set(CPU_SPEC_OPTIONS) == {
        "spec_name", "spec_module_path", "block_size", "num_cpu_blocks", "cpu_bytes_to_use",
        "eviction_policy", "transfer_timeout_s", "staging_blocks",
    }
    assert {row["name"]: row["required"] for row in describe_options(StorageOptions)} == {
        "path": True, "io_threads": False, "fsync": False, "io_timeout_s": False, "max_pending_save_bytes": False, "capacity_bytes": False,
    }
    assert [row["name"] for row in describe_options(MultiOptions) if row["required"]] == ["connectors"]


# -------------------------------------------------------------------- third-party components
class LegacyConnector(KVConnectorBase):
    """Written before options were declared: reads extra_config itself, any key goes."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, step: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class _NoTier(OffloadingSpec):
    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_handlers(self, kv_caches: dict[str, Any]) -> Iterator[Any]:
        yield from ()


class LegacySpec(_NoTier):
    """Written before options were declared."""


@dataclasses.dataclass(frozen=True)
class _OwnOptions:
    depth: int = option(1, doc="how deep")


class DeclaredSpec(_NoTier):
    """Declares its own options without subclassing OffloadingSpecOptions."""

    options_cls = _OwnOptions
    options_owner = "declared offloading spec"


def test_undeclared_connector_is_not_checked_and_sees_its_dict() -> None:
    # catches: a base class that treats "no options_cls" as "no options" and refuses every key
    config = KVTransferConfig("LegacyConnector", kv_connector_module_path=__name__,
                              kv_connector_extra_config={"anything": 1})
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, SPEC)
    assert connector.options == {"anything": 1} and connector.extra_config == {"anything": 1}


def test_undeclared_spec_is_not_checked_but_block_size_still_is() -> None:
    # catches: refusing an undeclared spec's keys, or dropping the base class's block_size check
    extra = {"spec_name": "LegacySpec", "spec_module_path": __name__, "whatever": True, "block_size": 8}
    spec = OffloadingSpecFactory.create_spec(KVTransferConfig("offloading", kv_connector_extra_config=extra), SPEC)
    assert spec.options == extra and spec.offloaded_block_size == 8
    wrong_type = "option 'block_size' in kv_connector_extra_config must be int"
    with pytest.raises(InvalidOptionError, match=re.escape(wrong_type)):
        OffloadingSpecFactory.create_spec(
            KVTransferConfig("offloading", kv_connector_extra_config={**extra, "block_size": "8"}), SPEC)


def test_a_spec_declaring_only_its_own_keys_still_takes_the_common_ones() -> None:
    # catches: reporting spec_name/spec_module_path/block_size as unknown for a spec whose
    # options_cls does not subclass OffloadingSpecOptions, or ignoring block_size for it
    extra = {"spec_name": "DeclaredSpec", "spec_module_path": __name__, "block_size": 8, "depth": 2}
    spec = OffloadingSpecFactory.create_spec(KVTransferConfig("offloading", kv_connector_extra_config=extra), SPEC)
    assert spec.options == _OwnOptions(2) and spec.offloaded_block_size == 8
    with pytest.raises(InvalidOptionError, match=re.escape(
        "declared offloading spec: unknown option(s) 'dept' (did you mean 'depth'?)"
    )):
        OffloadingSpecFactory.create_spec(
            KVTransferConfig("offloading", kv_connector_extra_config={**extra, "dept": 2}), SPEC)


def test_cpu_options_extend_the_common_ones() -> None:
    # catches: a cpu table that forgets the keys the factory and the base class read
    assert issubclass(CPUSpecOptions, OffloadingSpecOptions)
