"""Subclasses of torch's layers that define their own ``forward``: whether they still compute
their base's function, decided by running them on probe values rather than by reading them.
Tensor parallelism replaces a registered layer by its distributed version, which would replace
such a forward too; where the forward provably computes the base's function (Falcon's
``FalconLinear``: ``input @ weight.T + bias``) the replacement is exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["own_forward", "with_parameters", "computes_linear"]


def own_forward(module: nn.Module, base: type) -> type | None:
    """The class of ``module`` below ``base`` in its MRO that defines its own ``forward``, or
    None when ``base``'s forward is the one that runs."""
    for klass in type(module).__mro__:
        if klass is base:
            return None
        if "forward" in vars(klass):
            return klass
    return None


def with_parameters(module: nn.Module, cls: type, **params: torch.Tensor | None) -> nn.Module:
    """A copy of ``module`` of class ``cls`` sharing everything but ``params`` (a probe: its
    forward runs on other parameters while the module itself is untouched)."""
    copy = cls.__new__(cls)
    copy.__dict__.update(vars(module))
    copy.__dict__["_parameters"] = {**module._parameters, **params}
    return copy


_linear_verdicts: dict[tuple, bool] = {}
_MODULE_STATE = frozenset(vars(nn.Module()))  # torch's own bookkeeping (hook dicts, ...)


def computes_linear(module: nn.Linear) -> bool:
    """Whether ``module``, an ``nn.Linear`` whose class defines its own ``forward``, computes
    ``F.linear(input, weight, bias)``, so that a distributed linear layer replaces it exactly.

    Decided by running that forward, not by reading it: the module must hold nothing but
    ``weight`` and ``bias`` (no other parameter, buffer or submodule its forward could use),
    and its forward, given random float64 weights and inputs of two and three dimensions,
    must return float64 values equal to ``F.linear``'s (to 1e-9; the two only sum in another
    order). float64 makes a forward that fixes a dtype (an output cast to float32) fail.
    Random weights (from a generator of its own: torch's are left as they were), not the
    module's own, which may be zeros or not materialised yet (delayed initialisation). What
    such a probe cannot see (a forward that depends on the input's values beyond the probe, on
    training mode, or on state that changes) is the price of deciding this for any class; the
    alternative, keeping every such subclass whole, left Falcon's every projection whole.
    One verdict per class, sizes and plain attributes."""
    if type(module).forward is nn.Linear.forward:
        return True
    params = module._parameters
    if set(params) - {"weight", "bias"} or module._buffers or module._modules:
        return False
    plain = (bool, int, float, str, type(None))
    # By type and value: True and 1 are equal keys, but a forward may tell them apart.
    attributes = sorted(
        (k, type(v).__name__, v) for k, v in vars(module).items() if isinstance(v, plain)
    )
    others = [
        k
        for k, v in vars(module).items()
        if not isinstance(v, plain) and k not in _MODULE_STATE and not k.startswith("_smp")
    ]
    key = (type(module), module.in_features, module.out_features, params.get("bias") is not None,
           tuple(attributes))  # fmt: skip
    if not others and key in _linear_verdicts:
        return _linear_verdicts[key]
    verdict = _probe_linear(module)
    if not others:
        _linear_verdicts[key] = verdict
    return verdict


def _probe_linear(module: nn.Linear) -> bool:
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    weight = torch.randn(module.out_features, module.in_features, generator=g, dtype=f64)
    has_bias = module._parameters.get("bias") is not None
    bias = torch.randn(module.out_features, generator=g, dtype=f64) if has_bias else None
    probe = with_parameters(module, type(module), weight=weight, bias=bias)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for shape in ((2, module.in_features), (1, 2, module.in_features)):
            x = torch.randn(*shape, generator=g, dtype=f64)
            try:
                out = type(module).forward(probe, x)
            except Exception:  # noqa: BLE001 - any failure means "not a plain linear map"
                return False
            expected = F.linear(x, weight, bias)
            if not (
                torch.is_tensor(out)
                and out.dtype == f64
                and out.shape == expected.shape
                and torch.allclose(out, expected, rtol=1e-9, atol=1e-12)
            ):
                return False
    return True
