"""Proof, after every commit, that vLLM computes with the round's weights, layer by layer.

A reload that copies the right bytes into ``layer.weight`` is not enough: vLLM keeps state
derived from the weights (on CPU, GEMM weights packed at load time, oneDNN handles; tied heads
that receive no weights of their own), and its digests read ``layer.weight``, which the packing
may have emptied. So the probe looks at what vLLM will *compute*:

- while the round is loaded, each layer's weight is seen in checkpoint form (fused and sharded by
  vLLM's own loaders, before processing), and the product of a fixed probe row with a sample of
  its output rows (up to ``SAMPLED_ROWS``, spread over the whole matrix) is kept: a few MiB read
  per layer, not the weight;
- after the commit, the same row goes through the layer's real forward path
  (``quant_method.apply``: the packed kernel vLLM serves with, one read of every weight) and its
  sampled outputs must equal the kept product within bf16 rounding. A kernel built from stale or
  wrong weights differs in (nearly) every output, so a sample finds it.

A layer that disagrees fails the round, by name, with its relative error. Set
``WTRANSFER_VLLM_PROBE=0`` in vLLM's environment to skip it (the round is then trusted).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator
from typing import Any

from wtransfer_vllm.vllm_internals import layer_quant_method, patch_process_weights_after_loading

logger = logging.getLogger("vllm.wtransfer_vllm")

TOLERANCE = 1e-2
"""Largest relative error (norm of the difference / norm of the expected product) a layer may
show. The kernel's bf16 output alone is off by ~2e-3 (logged per round as the worst passing
layer), so this finds a layer computing with weights that differ from the round's by more than
about 1 % of their norm: a packed copy or tied head left from an earlier load, garbage, zeros,
the wrong shard or the wrong layout. It cannot tell the round's weights from those of one small
optimizer step before (bf16 outputs do not resolve that); the layerwise reload is what makes a
round's own bytes land."""
PROBED_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""Layers whose checkpoint-form weight ``W`` makes ``apply(layer, x) == x @ W.T``: every linear
layer and every (tied or not) LM head of an unquantized model. Quantized layers are not probed."""
SAMPLED_ROWS = 128
"""Output rows per layer whose product is checked (all of them in smaller layers)."""


def switched_on(variable: str) -> bool:
    """Whether the environment leaves ``variable`` on (unset, or anything but 0/false/no/off)."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return switched_on("WTRANSFER_VLLM_PROBE")


class ProbeMismatchError(RuntimeError):
    """After a commit, a layer of vLLM's model computes something other than the round's weights."""


@dataclass
class _Expected:
    module: Any
    probe: Any
    rows: Any
    product: Any


@dataclass
class CommitProbe:
    """Use as a context manager around the load; then :meth:`check` after the commit."""

    model: Any
    expected: dict[str, _Expected] = field(default_factory=dict)
    capture_seconds: float = 0.0
    unchecked: list[str] = field(default_factory=list)
    _installed: list[Callable[[], None]] = field(default_factory=list)  # what puts each hook back

    def _probed_layers(self) -> Iterator[tuple[str, Any, Any]]:
        """The probed layers that hold a weight parameter of their own (what a load writes into)."""
        for name, module, method in probed_layers(self.model):
            if getattr(module, "_parameters", {}).get("weight") is not None:
                yield name, module, method

    def _expect(self, name: str, module: Any) -> bool:
        """Keep what ``module`` must compute from its weight as it is now; False if it has none."""
        if not holds_2d_weight(module):
            return False
        weight = module.weight
        probe = probe_row(weight.shape[1], weight.dtype, weight.device)
        rows = sampled_rows(weight.shape[0], weight.device)
        self.expected[name] = _Expected(module, probe, rows, product_of(probe, weight, rows))
        return True

    def _expect_unprocessed_layers(self) -> None:
        expected = {id(item.module) for item in self.expected.values()}
        for name, module, _method in self._probed_layers():
            if id(module) not in expected and not self._expect(name, module):
                self.unchecked.append(name)
            expected.add(id(module))

    def __enter__(self) -> CommitProbe:
        seen: set[int] = set()
        for name, module, method in self._probed_layers():
            if id(method) in seen:
                continue
            seen.add(id(method))
            self._installed.append(
                patch_process_weights_after_loading(method, lambda previous: self._capturing(name, previous)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for restore in self._installed:
            restore()
        self._installed.clear()

    def _capturing(self, name: str, process: Any) -> Any:
        def process_weights_after_loading(layer: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            self._expect(name, layer)  # the weight as loaded, before processing packs it
            self.capture_seconds += time.perf_counter() - started
            return process(layer, *args, **kwargs)

        return process_weights_after_loading

    def check(self) -> dict[str, Any]:
        """Run every probed layer's real forward on its probe row; raise on any mismatch.

        Layers the load processed were captured then; any other (a tied head whose processing
        did not run again, a layer the round did not reach) is checked against its weight as it
        is now, where vLLM left one; a layer with neither is counted as unchecked."""
        import torch

        started = time.perf_counter()
        self._expect_unprocessed_layers()
        failed: list[tuple[str, float]] = []
        worst = 0.0
        with torch.no_grad():
            for name, item in self.expected.items():
                actual = kernel_output(item.module, item.probe, item.rows)
                error = relative_error(actual, item.product)
                if not error <= TOLERANCE:  # NaN fails too
                    failed.append((name, error))
                else:
                    worst = max(worst, error)
        seconds = time.perf_counter() - started
        report = {"layers": len(self.expected), "unchecked": self.unchecked, "capture_s": self.capture_seconds,
                  "check_s": seconds, "worst_passing_error": worst, "failed": [name for name, _ in failed]}
        if failed:
            shown = ", ".join(f"{name} (relative error {error:.3g})" for name, error in failed[:8])
            more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
            raise ProbeMismatchError(
                f"after the commit, {len(failed)} of {len(self.expected)} layer(s) of vLLM's model do not compute "
                f"with the round's weights: {shown}{more} (tolerance {TOLERANCE:g}). vLLM would serve stale or "
                f"wrong weights there; this worker's model is torn. A fresh round or a restart rebuilds it; "
                f"please report the model and the CPU (its flags) to wtransfer-vllm"
            )
        return report


def probed_layers(model: Any) -> Iterator[tuple[str, Any, Any]]:
    """Each layer of ``model`` whose quantization method is one of ``PROBED_METHODS``, under every name it
    has (a tied head too), with that method."""
    for name, module in model.named_modules(remove_duplicate=False):
        method = layer_quant_method(module)
        if type(method).__name__ in PROBED_METHODS:
            yield name, module, method


def holds_2d_weight(layer: Any) -> bool:
    """Whether ``layer`` keeps a 2-D weight with values (not one emptied by packing, nor on the meta device)."""
    weight = getattr(layer, "weight", None)
    return weight is not None and weight.dim() == 2 and not weight.is_meta and weight.numel() > 0


def kernel_output(layer: Any, probe: Any, rows: Any) -> Any:
    """``layer``'s real forward (``quant_method.apply``, the kernel vLLM serves with) on ``probe``, at output
    ``rows``, in float32."""
    return layer_quant_method(layer).apply(layer, probe).float()[:, rows]


def probe_row(features: int, dtype: Any, device: Any) -> Any:
    """One fixed pseudo-random input row (the same for every round and worker)."""
    import torch

    generator = torch.Generator().manual_seed(features)
    return torch.randn((1, features), generator=generator).to(dtype=dtype, device=device)


def sampled_rows(count: int, device: Any) -> Any:
    """Up to ``SAMPLED_ROWS`` output rows, evenly spread from the first to the last."""
    import torch

    if count <= SAMPLED_ROWS:
        return torch.arange(count, device=device)
    return torch.linspace(0, count - 1, SAMPLED_ROWS, device=device).round().long().unique()


def product_of(probe: Any, weight: Any, rows: Any) -> Any:
    """``probe @ weight[rows].T`` in float32: plain torch on the weight as loaded."""
    return probe.float() @ weight.index_select(0, rows).float().T


def relative_error(actual: Any, expected: Any) -> float:
    scale = float(expected.norm())
    return float((actual - expected).norm()) / (scale if scale > 0 else 1.0)
