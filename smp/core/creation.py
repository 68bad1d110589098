"""One patch of ``nn.Module.__init__`` shared by the contexts that mark modules at creation
(``smp.partition``, ``smp.tensor_parallelism``), so that they nest in any order.

While at least one :func:`creation_hook` context is open, every new module, right after
``nn.Module.__init__`` has run (before its subclass constructor creates submodules), is passed to
each open hook, innermost last.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from torch import nn

__all__ = ["creation_hook"]

_original_init = nn.Module.__init__
_lock = threading.Lock()
_hooks: list[Callable[[nn.Module], None]] = []


def _hooked_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    for hook in list(_hooks):
        hook(self)


@contextlib.contextmanager
def creation_hook(hook: Callable[[nn.Module], None]) -> Iterator[None]:
    """Calls ``hook(module)`` for every module created inside the context."""
    with _lock:
        _hooks.append(hook)
        nn.Module.__init__ = _hooked_init
    try:
        yield
    finally:
        with _lock:
            _hooks.remove(hook)
            if not _hooks:
                nn.Module.__init__ = _original_init
