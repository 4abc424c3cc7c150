"""A round checked against vLLM's own model, for models started without a local checkpoint.

A dummy load from a config-only directory (verl's rollout start), ``.bin`` weights or a hub id
missing from the local cache leave no safetensors headers to read (:mod:`wtransfer_vllm.checkpoint`),
but vLLM's model knows what it accepts: its ``load_weights`` maps each checkpoint name onto its
parameters (fusing q/k/v and gate/up, cutting each worker's TP shard), and its weight loaders
check the shapes. So the round is dry-run through them: every layer is put in checkpoint form on
the meta device (as vLLM's layerwise reload does), the round's names are loaded as meta tensors
of the round's shapes, and each weight loader call is counted, not written anywhere. The model's
memory is never touched, and its own tensors are back in place before the round moves a byte.

Refused, with the reason: a name ``load_weights`` rejects or loads nothing from, a shape a weight
loader rejects (at TP=1 also one it would cut: every element of a tensor must land), a dtype
that is neither the model's nor the parameter's, and every parameter the round (with the
committed copy a partial round is completed from) leaves unfilled or filled in part: vLLM would
rebuild that layer from uninitialised memory. At TP>1 a tensor larger than the model's along the
dimension vLLM shards is cut by vLLM's loader as at start-up; the checkpoint check catches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from wtransfer_vllm.vllm_internals import layers_in_checkpoint_form, load_numel, loaded_numel

SKIPPED_PARAMETERS = frozenset({"_expert_map", "expert_mask", "expert_global_to_physical",
                                "expert_physical_to_global", "expert_local_to_global", "e_score_correction_bias"})
"""Parameters vLLM builds itself rather than loads (its layerwise reload skips the same names)."""

Entry = tuple[str, str, tuple[int, ...]]


def dry_run_round(model: Any, entries: list[Entry], model_dtype: str, tp_size: int) -> list[str]:
    """Every reason the round ``entries`` (name, dtype, shape) cannot load into ``model``; empty if it can."""
    import torch

    problems: list[str] = []
    filled: dict[str, int] = {}  # "layer.parameter" -> elements the round copies into it
    landed: dict[str, int] = {}  # entry name -> elements of it copied anywhere
    targets: dict[str, set[str]] = {}  # entry name -> dtypes of the parameters it loads into
    current: list[str] = [""]

    def counting(key: str, loader: Any) -> Any:
        def count(*args: Any, **kwargs: Any) -> Any:
            landed.setdefault(current[0], 0)  # a weight loader took it up (and may raise on its shape)
            numel, returned = loaded_numel(loader, args, kwargs)
            filled[key] = filled.get(key, 0) + numel
            landed[current[0]] = landed.get(current[0], 0) + numel
            targets.setdefault(current[0], set()).add(str(parameters[key].dtype).removeprefix("torch."))
            return returned
        return count

    live = _live_owners(model)  # before the dry run: which live layer holds each parameter first
    with layers_in_checkpoint_form(model) as layers:
        parameters: dict[str, Any] = {}
        for layer_name, layer in layers:
            for name, tensor in list(layer._parameters.items()) + list(layer._buffers.items()):
                if tensor is not None and name not in SKIPPED_PARAMETERS:
                    key = _key(layer_name, name)
                    parameters[key] = tensor
                    tensor.weight_loader = counting(key, getattr(tensor, "weight_loader", None))
        # what vLLM's own load must fill: every parameter in checkpoint form, a tied one once
        required = [_key(layer_name, name) for layer_name, layer in layers for name, tensor in layer._parameters.items()
                    if tensor is not None and name not in SKIPPED_PARAMETERS and live.get(_key(layer_name, name), True)]
        totals = {key: load_numel(parameters[key]) for key in required}

        def feed(rest: list[Entry]) -> Iterator[tuple[str, Any]]:
            for name, dtype, shape in rest:
                current[0] = name
                yield name, torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")

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
                    problems.append(f"vLLM's model refused the round before its first tensor ({reason})")
                    break
                name, _, shape = remaining[at]
                problems.append(f"unknown tensor {name!r} (vLLM's model loads no parameter from it: {reason})"
                                if name not in landed else
                                f"{name!r}: shape {list(shape)} does not load into vLLM's model ({reason})")
                landed[name] = -1  # reported
                remaining = remaining[at + 1:]

    seen: set[str] = set()
    wrong_dtype: dict[str, list[str]] = {}
    for name, dtype, shape in entries:
        if name in seen:
            problems.append(f"{name!r} appears twice")
        seen.add(name)
        got = landed.get(name, 0)
        if got == 0:
            problems.append(f"unknown tensor {name!r} (vLLM's model loads nothing from it)")
        elif got > 0 and tp_size == 1 and got < _numel(shape):
            problems.append(f"{name!r}: shape {list(shape)} does not match vLLM's model ({got} of its "
                            f"{_numel(shape)} elements would load)")
        if got > 0 and dtype != model_dtype and dtype not in targets.get(name, set()):
            wrong_dtype.setdefault(dtype, []).append(name)
    for dtype, names in wrong_dtype.items():
        problems.append(f"{len(names)} tensor(s) in {dtype}, neither the model's {model_dtype} nor the dtype of the "
                        f"parameter they load into: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    short = sorted(key for key in required if filled.get(key, 0) < totals[key])
    if short:
        shown = ", ".join(f"{key} ({filled.get(key, 0)}/{totals[key]} elements)" for key in short[:8])
        problems.append(f"the round leaves {len(short)} of vLLM's parameter(s) unfilled or filled in part: {shown}"
                        + (f" and {len(short) - 8} more" if len(short) > 8 else "")
                        + " (every tensor they load from must be in the round)")
    return problems


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
