"""A round checked against vLLM's own model, for models started without a local checkpoint.

A dummy load from a config-only directory (verl's rollout start), ``.bin`` weights or a hub id
missing from the local cache leave no safetensors headers to read (:mod:`wtransfer_vllm.checkpoint`),
but vLLM's model knows what it accepts: its ``load_weights`` maps each checkpoint name onto its
parameters (fusing q/k/v and gate/up, cutting each worker's TP shard), and its weight loaders
check the shapes. So the round is dry-run through them: every layer is put in checkpoint form on
the meta device (as vLLM's layerwise reload does), the round's names are loaded as meta tensors
of the round's shapes, and what each weight loader writes is counted, on meta tensors only. The
model's memory is never touched, and its own tensors are back in place before a byte moves.

Refused, with the reason: a name ``load_weights`` rejects or loads nothing from, a shape a weight
loader rejects (at TP=1 also one it would cut: every element of a tensor must land), a dtype
that is neither the model's nor the parameter's, and every parameter the round (with the
committed copy a partial round is completed from) leaves unfilled or filled in part: vLLM would
rebuild that layer from uninitialised memory. A padded vocabulary's padding (rows vLLM zeroes
itself) counts as filled. Not caught: at TP>1, a tensor larger than the model's along the
dimension vLLM shards, which vLLM's loaders cut to each worker's slice, as at start-up. With
pipeline or expert parallelism a name this worker holds nothing of is another worker's, not
unknown; a misspelt name is then caught only in a whole round (the parameter it should fill stays
unfilled on its owner), not in a partial one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from wtransfer_vllm.checkpoint import CAST_TODO, NAMES_TODO, SHAPE_TODO, Problem
from wtransfer_vllm.vllm_internals import (
    disable_mtp_completeness_check,
    layers_in_checkpoint_form,
    load_numel,
    original_weight_loader,
    torchao_reload_off,
)

SKIPPED_PARAMETERS = frozenset({"_expert_map", "expert_mask", "expert_global_to_physical",
                                "expert_physical_to_global", "expert_local_to_global", "e_score_correction_bias"})
"""Parameters vLLM builds itself rather than loads (its layerwise reload skips the same names)."""

Entry = tuple[str, str, tuple[int, ...]]


def dry_run_round(model: Any, entries: list[Entry], model_dtype: str, tp_size: int,
                  names_span_workers: bool = False) -> list[Problem]:
    """Every reason the round ``entries`` (name, dtype, shape) cannot load into ``model``, as (cause,
    tensor, what to do); empty if it can. ``names_span_workers``: pipeline or expert parallelism, where a name may be another
    worker's. A dry run that fails for another reason is a refusal too, with its error."""
    try:
        return _dry_run(model, entries, model_dtype, tp_size, names_span_workers)
    except Exception as exc:  # never a hang or a bare error: the trainer is told why, before any byte
        return [(f"the dry run of the round through vLLM's model failed ({type(exc).__name__}: {str(exc)[:300]})",
                 None, "start vLLM from a local safetensors checkpoint to have rounds checked against it instead")]


def _dry_run(model: Any, entries: list[Entry], model_dtype: str, tp_size: int, names_span_workers: bool) -> list[Problem]:
    problems: list[Problem] = []
    filled: dict[str, int] = {}  # "layer.parameter" -> elements the round writes into it
    landed: dict[str, int] = {}  # entry name -> elements of it copied anywhere
    targets: dict[str, set[str]] = {}  # entry name -> dtypes of the parameters it loads into
    current: list[str] = [""]

    def counting(key: str, loader: Any) -> Any:
        def count(*args: Any, **kwargs: Any) -> Any:
            landed.setdefault(current[0], 0)  # a weight loader took it up (and may raise on its shape)
            with _Writes() as writes:
                returned = loader(*args, **kwargs)
            total = load_numel(parameters[key])
            # a region zeroed beside the copies is a padded vocabulary's padding; a whole one is not data
            padding = sum(numel for numel in writes.filled if numel < total)
            filled[key] = min(filled.get(key, 0) + min(writes.copied, total) + padding, total)
            landed[current[0]] += min(writes.copied, total)
            targets.setdefault(current[0], set()).add(str(parameters[key].dtype).removeprefix("torch."))
            return returned
        return count

    live = _live_owners(model)  # before the dry run: which live layer holds each parameter first
    with torchao_reload_off(model), layers_in_checkpoint_form(model) as layers, disable_mtp_completeness_check():
        parameters: dict[str, Any] = {}
        for layer_name, layer in layers:
            for name, tensor in list(layer._parameters.items()) + list(layer._buffers.items()):
                if tensor is not None and name not in SKIPPED_PARAMETERS:
                    key = _key(layer_name, name)
                    parameters[key] = tensor
                    tensor.weight_loader = counting(key, original_weight_loader(tensor))
        # what vLLM's own load must fill: every parameter in checkpoint form, a tied one once
        required = [_key(layer_name, name) for layer_name, layer in layers
                    for name, tensor in layer._parameters.items()
                    if tensor is not None and name not in SKIPPED_PARAMETERS and live.get(_key(layer_name, name), True)]
        totals = {key: load_numel(parameters[key]) for key in required}
        problems += _feed(model, entries, current, landed)

    seen: set[str] = set()
    wrong_dtype: dict[str, list[str]] = {}
    for name, dtype, shape in entries:
        if name in seen:
            problems.append(("sent twice in one round", name, "send each tensor once a round"))
        seen.add(name)
        got = landed.get(name, 0)
        if got == 0 and not names_span_workers:
            problems.append(("unknown tensor, vLLM's model loads nothing from it", name, NAMES_TODO))
        elif got > 0 and tp_size == 1 and got < _numel(shape):
            problems.append((f"shape {list(shape)} does not match vLLM's model ({got} of its {_numel(shape)} "
                             f"elements would load)", name, SHAPE_TODO))
        if got > 0 and dtype != model_dtype and dtype not in targets.get(name, set()):
            wrong_dtype.setdefault(dtype, []).append(name)
    for dtype, names in wrong_dtype.items():
        problems += [(f"dtype {dtype}, neither the model's {model_dtype} nor the dtype of the parameter it loads "
                      f"into", name, CAST_TODO) for name in names]
    short = sorted(key for key in required if filled.get(key, 0) < totals[key])
    if short:
        shown = ", ".join(f"{key} ({filled.get(key, 0)}/{totals[key]} elements)" for key in short[:8])
        problems.append((f"the round leaves {len(short)} of vLLM's parameter(s) unfilled or filled in part: {shown}"
                         + (f" and {len(short) - 8} more" if len(short) > 8 else ""), None,
                         "send every tensor those parameters load from (q, k and v together; gate and up together), "
                         "or create_trainer(..., partial=True) to keep the ones a round leaves out"))
    return problems


def _feed(model: Any, entries: list[Entry], current: list[str], landed: dict[str, int]) -> list[Problem]:
    """Load ``entries`` as meta tensors through ``model.load_weights``; an entry it raises on is a
    problem (named), and the entries after it are loaded by a new call."""
    import torch

    problems: list[Problem] = []

    def feed(rest: list[Entry]) -> Iterator[tuple[str, Any]]:
        for name, dtype, shape in rest:
            current[0] = name
            yield name, torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")
        current[0] = ""  # every entry given: an error now is the model's own check of the whole

    remaining = list(entries)
    while remaining:
        current[0] = ""
        try:
            model.load_weights(feed(remaining))
            break
        except Exception as exc:  # the entry being loaded: say why, go on with the ones after it
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            at = next((i for i, entry in enumerate(remaining) if entry[0] == current[0]), None)
            if at is None:
                problems.append((f"vLLM's model refused the round as a whole ({reason})", None, SHAPE_TODO))
                break
            name, _, shape = remaining[at]
            problems.append((f"unknown tensor, vLLM's model loads no parameter from it ({reason})", name, NAMES_TODO)
                            if name not in landed else
                            (f"shape {list(shape)} does not load into vLLM's model ({reason})", name, SHAPE_TODO))
            landed[name] = -1  # reported
            remaining = remaining[at + 1:]
    return problems


class _Writes:
    """Counts what a weight loader writes: elements copied, and the sizes of regions it fills
    with a constant (``fill_``/``zero_``: how vLLM pads a vocabulary's extra rows)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        writes = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                import torch

                aten = torch.ops.aten
                if func is aten.copy_.default:
                    writes.copied += args[0].numel()
                elif func in (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default):
                    writes.filled.append(args[0].numel())
                return func(*args, **(kwargs or {}))

        self.copied = 0
        self.filled: list[int] = []
        self._mode = Mode()

    def __enter__(self) -> _Writes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def _live_owners(model: Any) -> dict[str, bool]:
    """``"layer.parameter"`` -> False where the live model's parameter is one an earlier layer holds
    (a tied LM head's weight is the embedding's: the checkpoint fills it once, through the embedding)."""
    seen: set[int] = set()
    owners: dict[str, bool] = {}
    for layer_name, layer in model.named_modules():
        for name, tensor in layer._parameters.items():
            if tensor is not None:
                owners[_key(layer_name, name)] = id(tensor) not in seen
                seen.add(id(tensor))
    return owners


def _key(layer_name: str, name: str) -> str:
    return f"{layer_name}.{name}" if layer_name else name


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
