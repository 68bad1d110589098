"""smp.optimizers (SMP v1): fused optimizers for model-parallel training."""

from __future__ import annotations

from smp.core.unbuilt import placeholder

__all__ = ["FusedLamb", "FusedLAMB", "FusedNovoGrad"]

FusedLamb = placeholder("smp.optimizers.FusedLamb", "a fused LAMB optimizer")
FusedLAMB = FusedLamb  # the spelling of NVIDIA apex, which v1 scripts also use
FusedNovoGrad = placeholder("smp.optimizers.FusedNovoGrad", "a fused NovoGrad optimizer")
