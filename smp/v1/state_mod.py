"""SMP v1's ``state_mod`` module, for scripts that import ``state`` from it: ``state.cfg`` is the
running configuration (as ``smp.state.cfg``)."""

from __future__ import annotations

from smp.config import Config
from smp.state import get_state

__all__ = ["state"]


class _V1State:
    """v1's process-wide state object, as far as scripts read it."""

    @property
    def cfg(self) -> Config:
        return get_state().config


state = _V1State()
