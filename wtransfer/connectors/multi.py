"""``multi``: several connectors behind one, e.g. a fast local store in front of a shared one.

``kv_connector_extra_config["connectors"]`` is a list of child configs, each a dict of
:class:`~wtransfer.config.KVTransferConfig` fields (``kv_connector``, usually ``kv_connector_extra_config``;
``kv_role`` and ``engine_id`` default to the parent's). Children are created through ``KVConnectorFactory``, so any
installed connector plugin can be one.

* Loads come from the first child, in list order, that reports a hit; the others are told there are no external
  tokens.
* Saves go to every child (each decides what it saves).
* A finished request is done sending once every child that delayed its free has finished saving; done receiving
  once the loading child is.
* The children's ``kv_transfer_params`` are merged; two children giving one key different values is an error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from wtransfer.config import KVTransferConfig
from wtransfer.connectors._base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from wtransfer.kvcache import KV_LAYOUTS
from wtransfer.options import option

if TYPE_CHECKING:
    import torch

    from wtransfer.connectors._request import KVConnectorOutput, KVRequest, SchedulerStep
    from wtransfer.kvcache import KVCacheSpec

logger = logging.getLogger("wtransfer")


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    """Each child's metadata dict, in child order, plus how many children must report each finished request before
    it counts as done sending."""

    children: list[dict[str, Any]] = field(default_factory=list)
    expected_senders: dict[str, int] = field(default_factory=dict)
    loads: dict[str, list[int]] = field(default_factory=dict)
    """request id -> cache blocks a child loads for it this step (to tell the other children which requests computed
    on top of a failed load)."""


_CHILDREN_EXAMPLE = "[{'kv_connector': 'storage', 'kv_connector_extra_config': {'path': ...}}]"


@dataclass(frozen=True)
class MultiOptions:
    """``kv_connector_extra_config`` of the multi connector: only its children."""

    connectors: list[Any] = option(
        doc=f"child connector configs in lookup order, dicts of KVTransferConfig fields, e.g. {_CHILDREN_EXAMPLE}"
    )

    def __post_init__(self) -> None:
        if not self.connectors:
            raise ValueError(
                f"option 'connectors' must list at least one child connector config, e.g. {_CHILDREN_EXAMPLE}"
            )


def _child_configs(parent: KVTransferConfig, options: MultiOptions) -> list[KVTransferConfig]:
    configs: list[KVTransferConfig] = []
    for position, child in enumerate(options.connectors):
        if isinstance(child, KVTransferConfig):
            configs.append(child)
            continue
        if not isinstance(child, dict) or "kv_connector" not in child:
            raise ValueError(
                f"multi connector: child #{position} must be a dict with at least 'kv_connector', got {child!r}"
            )
        data = {"kv_role": parent.kv_role, "engine_id": parent.engine_id, **child}
        try:
            configs.append(KVTransferConfig.from_dict(data))
        except TypeError as exc:
            raise ValueError(
                f"multi connector: child #{position} has fields KVTransferConfig does not know: {exc}"
            ) from None
    return configs


class MultiConnector(KVConnectorBase):
    """Composes child connectors: first hit loads, all save, done when all are done."""

    metadata_cls = MultiConnectorMetadata
    supported_layouts = tuple(KV_LAYOUTS)  # each child is checked against the layout when it is created
    handles_parts = True  # each child is checked too
    options_cls = MultiOptions
    options_owner = "multi connector"
    options: MultiOptions

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec | None = None
    ) -> None:
        super().__init__(config, role, kv_cache_spec)  # checks the top level; each child checks its own options
        from wtransfer.connectors._factory import KVConnectorFactory

        self.children: list[KVConnectorBase] = []
        try:
            for child_config in _child_configs(config, self.options):
                self.children.append(KVConnectorFactory.create_connector(child_config, role, kv_cache_spec))
        except BaseException:
            for child in self.children:
                child.shutdown()
            raise
        # scheduler state
        self._loading_child: dict[str, int] = {}
        self._expected_senders: dict[str, int] = {}
        self._loads: dict[str, list[int]] = {}
        # worker state
        self._sent_reports: Counter[str] = Counter()
        self._expected_on_worker: dict[str, int] = {}
        self._load_errors: set[int] = set()

    def _child_names(self) -> str:
        return ", ".join(f"#{i} {c.config.kv_connector}" for i, c in enumerate(self.children))

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._loading_child.pop(request.request_id, None)
        for index, child in enumerate(self.children):
            count, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if count is None:
                return None, False  # this child cannot answer yet: ask again rather than skip it
            if count > 0:
                self._loading_child[request.request_id] = index
                return count, load_async
        return 0, False

    def update_state_after_alloc(self, request: KVRequest, block_ids: list[int], num_external_tokens: int) -> None:
        loader = self._loading_child.pop(request.request_id, None)
        for index, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if index == loader else 0)
        if loader is not None and num_external_tokens > 0:
            block_size = self.require_spec().block_size
            first = request.num_computed_tokens // block_size
            last = -(-(request.num_computed_tokens + num_external_tokens) // block_size)
            self._loads[request.request_id] = list(block_ids[first:last])

    def build_connector_meta(self, step: SchedulerStep) -> MultiConnectorMetadata:
        children = [child.build_connector_meta(step).to_dict() for child in self.children]
        expected = {rid: n for rid, n in self._expected_senders.items() if rid in set(step.finished_req_ids)}
        for rid in expected:
            del self._expected_senders[rid]
        loads, self._loads = self._loads, {}
        return MultiConnectorMetadata(children=children, expected_senders=expected, loads=loads)

    def request_finished(self, request: KVRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loading_child.pop(request.request_id, None)
        delaying = 0
        merged: dict[str, Any] = {}
        owners: dict[str, int] = {}
        conflict: str | None = None
        for index, child in enumerate(self.children):
            delay, params = child.request_finished(request, block_ids)
            delaying += bool(delay)
            for key, value in (params or {}).items():
                if key in merged and merged[key] != value:
                    conflict = conflict or (
                        f"multi connector: children #{owners[key]} ({self.children[owners[key]].config.kv_connector}) "
                        f"and #{index} ({child.config.kv_connector}) both set kv_transfer_params[{key!r}] "
                        f"for request {request.request_id!r} with different values; give the children distinct keys"
                    )
                merged.setdefault(key, value)
                owners.setdefault(key, index)
        if delaying:
            self._expected_senders[request.request_id] = delaying
        if conflict is not None:
            raise ValueError(conflict)
        return delaying > 0, (merged or None)

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self.children:
            child.register_kv_caches(kv_caches)

    def _children_metadata(self, connector_metadata: KVConnectorMetadata) -> list[KVConnectorMetadata]:
        """Each child's own metadata, rebuilt from the step's (which must be a multi connector's)."""
        if not isinstance(connector_metadata, MultiConnectorMetadata):
            raise TypeError(
                f"multi connector: expected MultiConnectorMetadata, got {type(connector_metadata).__name__}"
            )
        if len(connector_metadata.children) != len(self.children):
            raise ValueError(
                f"multi connector: metadata has {len(connector_metadata.children)} children, this worker has "
                f"{len(self.children)} ({self._child_names()}); scheduler and worker configs differ"
            )
        return [type(child).metadata_cls.from_dict(data)
                for child, data in zip(self.children, connector_metadata.children, strict=True)]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        children = self._children_metadata(connector_metadata)
        super().bind_connector_metadata(connector_metadata)
        self._expected_on_worker.update(connector_metadata.expected_senders)  # type: ignore[attr-defined]
        for child, metadata in zip(self.children, children):
            child.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.children:
            child.clear_connector_metadata()

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        for child, metadata in zip(self.children, self._children_metadata(connector_metadata)):
            child.handle_preemptions(metadata)

    def start_load_kv(self, **kwargs: Any) -> None:
        for child in self.children:
            child.start_load_kv(**kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer_name)
        self._stop_saves_after_failed_loads()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kwargs: Any) -> None:
        self._stop_saves_after_failed_loads()
        for child in self.children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._stop_saves_after_failed_loads()
        for child in self.children:
            child.wait_for_save()

    def _stop_saves_after_failed_loads(self) -> None:
        """As soon as loads are in (and again before saving): collect the children's load failures and tell every
        child not to save what the affected requests compute on top of them."""
        if not self.has_connector_metadata():
            return
        failed: set[int] = set()
        for child in self.children:
            failed |= child.get_block_ids_with_load_errors()
        if not failed:
            return
        self._load_errors |= failed
        meta = cast(MultiConnectorMetadata, self._get_connector_metadata())  # checked against metadata_cls
        requests = {rid for rid, blocks in meta.loads.items() if failed.intersection(blocks)}
        for child in self.children:
            child.skip_saves(requests)

    def skip_saves(self, request_ids: set[str]) -> None:
        for child in self.children:
            child.skip_saves(request_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        receiving: set[str] = set()
        for child in self.children:
            sent, received = child.get_finished(finished_req_ids)
            self._sent_reports.update(sent or ())
            receiving |= received or set()
        done = {rid for rid, n in self._expected_on_worker.items() if self._sent_reports[rid] >= n}
        for rid in done:
            del self._expected_on_worker[rid]
            del self._sent_reports[rid]
        return (done or None), (receiving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        for child in self.children:
            errors |= child.get_block_ids_with_load_errors()
        return errors

    def build_connector_worker_meta(self) -> dict[str, Any] | None:
        """Each child's report, keyed by its position in the list."""
        reports = {str(i): r for i, child in enumerate(self.children) if (r := child.build_connector_worker_meta())}
        return {"children": reports} if reports else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Each child hears the step's transfers and only its own workers' reports."""
        for index, child in enumerate(self.children):
            mine = [m["children"][str(index)] for m in output.worker_meta if str(index) in m.get("children", {})]
            child.update_connector_output(dataclasses.replace(output, worker_meta=mine))

    def get_kv_connector_stats(self) -> dict[str, Any]:
        return {
            f"{index}:{child.config.kv_connector}": child.get_kv_connector_stats()
            for index, child in enumerate(self.children)
        }

    def shutdown(self) -> None:
        """Shut every child down; safe to call twice, as the contract makes every child's ``shutdown``."""
        errors: list[BaseException] = []
        for child in self.children:
            try:
                child.shutdown()
            except Exception as exc:  # shut every child down, then report
                logger.error("multi connector: child %s failed to shut down: %r", child.config.kv_connector, exc)
                errors.append(exc)
        if errors:
            raise errors[0]
