"""The direct load's verdict, branch by branch, on small torch layers shaped as vLLM's (no vLLM needed).

A real vLLM reaches one branch per host (test_commit_probe.py: on hosts where vLLM computes from the live
weight, a layer made to read a copy; where it packs every weight, the empty weights). These layers reach
every refusal on every host but one: weights off the CPU (no other device here). Each layer has a ``quant_method`` whose class name is vLLM's, and whose
``apply`` is the kernel under test: one that reads ``layer.weight``, one that reads a copy taken earlier
(as a packed GEMM weight is), one that raises.
"""

from __future__ import annotations

import types

import pytest
import torch

from wtransfer_vllm.direct_load import DirectLoad


class UnquantizedLinearMethod:
    """Named as vLLM's: the direct load recognises layers by their method's class name."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.cpu_linear(x, layer.weight, bias)


class Fp8LinearMethod(UnquantizedLinearMethod):
    """Any other method: its processing may derive state from the weight."""


def _model(layers: int = 2, method: type = UnquantizedLinearMethod) -> torch.nn.Module:
    model = torch.nn.Module()
    for index in range(layers):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(48, 32, generator=torch.Generator().manual_seed(index))
                                          .to(torch.bfloat16), requires_grad=False)
        layer.quant_method = method()
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
        model.add_module(f"proj{index}", layer)
    return model


def _packed(layer: torch.nn.Module) -> None:
    copy = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, copy, bias)


def test_kernels_reading_the_live_weight_are_accepted_and_left_bit_for_bit_as_they_were() -> None:
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    direct = DirectLoad(model)
    assert direct.refusal() is None
    assert direct.check_seconds > 0
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert direct.refusal() is None and direct.check_seconds == 0  # the verdict is reused


def test_a_kernel_reading_a_copy_of_its_weight_is_refused_by_name() -> None:
    """The copy equals the weight when tested: only the negated rows tell them apart."""
    model = _model()
    _packed(model.proj1)
    refusal = DirectLoad(model).refusal()
    assert refusal is not None and refusal.startswith("proj1: its kernel does not read the live weight"), refusal


def test_an_acceptance_is_tested_again_once_a_kernel_or_weight_is_rebound() -> None:
    model = _model()
    direct = DirectLoad(model)
    assert direct.refusal() is None
    _packed(model.proj0)  # the kernel rebound, as a layerwise reload's processing rebinds it
    assert (direct.refusal() or "").startswith("proj0: its kernel does not read the live weight")

    model = _model()
    direct = DirectLoad(model)
    assert direct.refusal() is None
    model.proj1.weight = torch.nn.Parameter(model.proj1.weight.detach().clone(), requires_grad=False)
    assert direct.refusal() is None and direct.check_seconds > 0  # tested again: still reads its (new) weight

    direct.forget()
    assert direct.refusal() is None and direct.check_seconds > 0


def _reading(layer: torch.nn.Module):  # noqa: ANN202
    return lambda x, weight, bias: torch.nn.functional.linear(x, layer.weight, bias)


def test_a_kernel_rebound_to_the_same_code_over_the_same_objects_is_not_tested_again() -> None:
    """vLLM's processing binds a new fallback lambda on every load (its own reload included): same code,
    nothing captured, so it computes as the last did. Same code over another captured object does not."""
    model = _model()
    direct = DirectLoad(model)
    assert direct.refusal() is None
    model.proj0.cpu_linear = _model(1).proj0.cpu_linear  # a new function object from the same line
    assert direct.refusal() is None and direct.check_seconds == 0

    model.proj0.cpu_linear = _reading(model.proj0)
    assert direct.refusal() is None and direct.check_seconds > 0  # other code: tested, and it reads the weight
    model.proj0.cpu_linear = _reading(model.proj0)
    assert direct.refusal() is None and direct.check_seconds == 0  # the same code over the same layer
    model.proj0.cpu_linear = _reading(model.proj1)  # the same code over another layer's weight
    assert (direct.refusal() or "").startswith("proj0: its kernel does not read the live weight")


def _scaled(scale: float = 1.0, *, sign: int = 1):  # noqa: ANN202
    return lambda x, weight, bias, _scale=scale, *, _sign=sign: torch.nn.functional.linear(x, weight * _scale * _sign, bias)


class _Kernel:
    def __init__(self, source: torch.nn.Module | None = None) -> None:
        self.source = source

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight if self.source is None else self.source.weight, bias)


def test_a_new_kernel_with_other_defaults_values_or_object_is_tested_again() -> None:
    """Defaults (positional and keyword), their types, and a bound method's object are part of what a
    kernel runs: each binding below differs from the one before in one of them alone."""
    model = _model()
    direct = DirectLoad(model)
    model.proj0.cpu_linear = _scaled(1.0, sign=1)
    assert direct.refusal() is None and direct.check_seconds > 0
    model.proj0.cpu_linear = _scaled(1.0, sign=1)
    assert direct.refusal() is None and direct.check_seconds == 0
    for other in (_scaled(True, sign=1), _scaled(1, sign=1), _scaled(1.0, sign=1), _scaled(1.0, sign=True)):
        model.proj0.cpu_linear = other
        assert direct.refusal() is None and direct.check_seconds > 0, (other.__defaults__, other.__kwdefaults__)

    kernel = _Kernel()
    model.proj1.cpu_linear = kernel.linear
    assert direct.refusal() is None and direct.check_seconds > 0
    model.proj1.cpu_linear = kernel.linear  # a new bound method of the same object
    assert direct.refusal() is None and direct.check_seconds == 0
    model.proj1.cpu_linear = _Kernel(model.proj0).linear  # another object: reads proj0's weight
    assert (direct.refusal() or "").startswith("proj1: its kernel does not read the live weight")


def _bound_to_itself():  # noqa: ANN202
    """A method bound to its own function, which captures the method: comparing it must end."""
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert bound is not None
        return torch.nn.functional.linear(x, weight, bias)

    bound = types.MethodType(linear, linear)
    return bound


def test_a_kernel_that_refers_to_itself_is_compared_without_end() -> None:
    model = _model()
    direct = DirectLoad(model)
    model.proj0.cpu_linear = _bound_to_itself()
    assert direct.refusal() is None and direct.check_seconds > 0
    assert direct.refusal() is None and direct.check_seconds == 0  # compared with itself, and reused
    model.proj0.cpu_linear = _bound_to_itself()  # the same code, captured objects of its own: tested again
    assert direct.refusal() is None and direct.check_seconds > 0


def test_a_layer_without_a_weight_of_its_own_is_refused() -> None:
    model = _model()
    model.proj0.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    refusal = DirectLoad(model).refusal()
    assert refusal is not None and refusal.startswith("proj0 keeps no 2-D weight of its own"), refusal


def test_another_quantization_method_is_refused() -> None:
    refusal = DirectLoad(_model(method=Fp8LinearMethod)).refusal()
    assert refusal is not None and "proj0 (Fp8LinearMethod)" in refusal, refusal


def test_a_kernel_that_raises_is_refused_and_its_weight_put_back() -> None:
    model = _model()
    before = model.proj0.weight.detach().clone()
    calls = []

    def failing(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(weight.detach().clone())
        if len(calls) == 2:  # after the rows were negated
            raise RuntimeError("kernel failed")
        return torch.nn.functional.linear(x, weight, bias)

    model.proj0.cpu_linear = failing
    refusal = DirectLoad(model).refusal()
    assert refusal == "testing the kernels raised RuntimeError: kernel failed", refusal
    assert not torch.equal(calls[1], before)  # it did fail with rows negated
    assert torch.equal(model.proj0.weight, before)


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WTRANSFER_VLLM_DIRECT_LOAD", "0")
    assert DirectLoad(_model()).refusal() == "turned off by WTRANSFER_VLLM_DIRECT_LOAD=0"


def test_nothing_to_load_into_and_rows_that_cannot_tell_are_refused() -> None:
    assert DirectLoad(torch.nn.Module()).refusal() == "no unquantized linear layer or embedding to load into"
    model = _model()
    with torch.no_grad():
        model.proj0.weight.zero_()
    refusal = DirectLoad(model).refusal()
    assert refusal is not None and refusal.startswith("proj0: its sampled weight rows are all zero"), refusal


def test_other_post_load_steps_are_refused() -> None:
    """A layer with a post-load step of its own that holds parameters (as MLA's does), or a model-level hook."""
    model = _model()
    attention = torch.nn.Module()
    attention.kv_b_proj = torch.nn.Linear(4, 4)
    attention.process_weights_after_loading = lambda act_dtype: None
    model.add_module("attn", attention)
    refusal = DirectLoad(model).refusal()
    assert refusal is not None and "attn (Module's own post-load step)" in refusal, refusal

    attention.kv_b_proj = torch.nn.Identity()  # no parameters: it can derive nothing from a weight
    assert DirectLoad(model).refusal() is None

    model.process_weights_after_loading = lambda: None
    refusal = DirectLoad(model).refusal()
    assert refusal is not None and "the model's own process_weights_after_loading" in refusal, refusal
