"""smp.amp (SMP v1): a gradient scaler for scripts that scale fp16 losses themselves."""

from __future__ import annotations

from smp._unbuilt import placeholder

__all__ = ["GradScaler"]

GradScaler = placeholder("smp.amp.GradScaler", "fp16 loss scaling across model-parallel ranks")
