"""Whether a plain ``model.load_weights`` is the whole commit: vLLM's kernels read the weights it writes.

vLLM processes each layer's weights once they are loaded. On CPUs with AVX-512 or AMX it packs them
for its GEMM kernels (and empties ``layer.weight``); an MLA layer derives absorbed matrices; a
quantized layer re-quantizes. A round therefore goes through vLLM's layerwise reload, which runs
that processing again. Where the processing derives nothing (on AVX2 hosts vLLM's CPU GEMM falls
back to ``torch.nn.functional.linear`` over the live weight), the layerwise reload only copies the
round one more time and re-runs a processing that changes nothing, and a plain ``load_weights``
(what TRL's colocate sync calls) reaches the same state in about half the time.

:class:`DirectLoad` decides, per model, from what vLLM would compute and not from the host's name:

- nothing but unquantized linear layers and embeddings may have a post-load processing
  (:func:`~wtransfer_vllm.vllm_internals.processing_beyond_plain_kernels`), and each of them must
  keep a weight;
- each such layer's kernel must read that very weight. Its forward (``quant_method.apply``, the
  kernel vLLM serves with) runs on a probe row, then again with a sample of the weight's rows
  negated in place: a kernel reading the live weight flips those outputs' sign, one reading a
  packed or copied weight does not. The rows are put back bit for bit (negation is exact), and
  the test compares no weights across rounds, so an update too small for the commit probe's
  tolerance cannot pass it by accident.

A refusal holds for the model's life (the processing is the same at every load); an acceptance is
tested again when a layer's weight tensor is replaced (vLLM's own ``reload_weights``, for one).
Set ``WTRANSFER_VLLM_DIRECT_LOAD=0`` in vLLM's environment to always use the layerwise reload.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

from wtransfer_vllm.probe import PROBED_METHODS, TOLERANCE, probe_row, product_of, relative_error, sampled_rows
from wtransfer_vllm.vllm_internals import layer_quant_method, processing_beyond_plain_kernels


def enabled() -> bool:
    return os.environ.get("WTRANSFER_VLLM_DIRECT_LOAD", "1").strip().lower() not in ("0", "false", "no", "off")


class DirectLoad:
    """The verdict for one vLLM model: :meth:`refusal` is None where a plain ``load_weights`` is exact."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.refused: str | None = None
        self.check_seconds = 0.0
        """How long the last test of the kernels took (0 when the last verdict was reused)."""
        self._accepted: list[tuple[Any, Any, int]] = []  # (layer, weight) weak references and the weight's address

    def refusal(self) -> str | None:
        """None when a plain ``load_weights`` reaches what vLLM computes with; otherwise why not."""
        self.check_seconds = 0.0
        if not enabled():
            return "turned off by WTRANSFER_VLLM_DIRECT_LOAD=0"
        if self.refused is None and not self._still_accepted():
            started = time.perf_counter()
            self.refused = self._test()
            self.check_seconds = time.perf_counter() - started
            self._accepted = [] if self.refused else [(weakref.ref(layer), weakref.ref(layer.weight),
                                                       layer.weight.data_ptr()) for _, layer in self._layers()]
        return self.refused

    def _layers(self) -> Iterator[tuple[str, Any]]:
        for name, layer in self.model.named_modules(remove_duplicate=False):
            if type(layer_quant_method(layer)).__name__ in PROBED_METHODS:
                yield name, layer

    def _still_accepted(self) -> bool:
        layers = list(self._layers())
        return bool(self._accepted) and len(layers) == len(self._accepted) and all(
            layer_ref() is layer and weight_ref() is layer.weight and layer.weight.data_ptr() == address
            for (_, layer), (layer_ref, weight_ref, address) in zip(layers, self._accepted))

    def _test(self) -> str | None:
        beyond = processing_beyond_plain_kernels(self.model, PROBED_METHODS)
        if beyond:
            return f"vLLM derives state after loading for {', '.join(beyond[:4])}" + (
                f" and {len(beyond) - 4} more" if len(beyond) > 4 else "")
        layers = list(self._layers())
        if not layers:
            return "no unquantized linear layer or embedding to load into"
        for name, layer in layers:
            weight = getattr(layer, "weight", None)
            if weight is None or weight.dim() != 2 or weight.is_meta or weight.numel() == 0:
                return f"{name} keeps no weight of its own after processing (its kernel holds a packed copy)"
        for name, layer in layers:
            why = kernel_reads_weight(layer)
            if why:
                return f"{name}: {why}"
        return None


def kernel_reads_weight(layer: Any) -> str | None:
    """None when ``layer``'s forward kernel reads ``layer.weight`` itself; otherwise what it showed.

    Runs the kernel on a probe row, negates a sample of the weight's rows in place, runs it again,
    and puts the rows back (exactly: negating a float is exact). The sampled outputs must equal the
    plain product of the probe row and the weight, then its negation."""
    import torch

    weight = layer.weight
    method = layer_quant_method(layer)
    probe = probe_row(weight.shape[1], weight.dtype, weight.device)
    rows = sampled_rows(weight.shape[0], weight.device)
    expected = product_of(probe, weight, rows)
    if float(expected.norm()) == 0.0:
        return "its sampled weight rows are all zero, so the test cannot tell what its kernel reads"
    with torch.no_grad():
        before = method.apply(layer, probe).float()[:, rows]
        original = weight.index_select(0, rows)
        weight.index_copy_(0, rows, original.neg())
        try:
            after = method.apply(layer, probe).float()[:, rows]
        finally:
            weight.index_copy_(0, rows, original)
    error_before = relative_error(before, expected)
    error_after = relative_error(after, expected.neg())
    if not (error_before <= TOLERANCE and error_after <= TOLERANCE):  # NaN refuses too
        return (f"its kernel does not read the live weight (relative error {error_before:.3g} before and "
                f"{error_after:.3g} after negating sampled rows; tolerance {TOLERANCE:g})")
    return None
