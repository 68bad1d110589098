"""SMP v1's package names, for scripts that reach past ``smdistributed.modelparallel.torch``.

A v1 script that imports the parent package, e.g. to log its version::

    import smdistributed.modelparallel
    print(smdistributed.modelparallel.__version__)

ports by changing that import as well::

    from smp.compat import smdistributed

``smdistributed.modelparallel.torch`` is ``smp`` itself, and ``smdistributed.modelparallel``
carries smp's ``__version__``.
"""

from __future__ import annotations

import types

import smp

__all__ = ["smdistributed"]

modelparallel = types.ModuleType(
    "smdistributed.modelparallel", "smp under SMP v1's package name (see smp.compat)"
)
modelparallel.__version__ = smp.__version__
modelparallel.torch = smp

smdistributed = types.ModuleType("smdistributed", "SMP v1's top-level package name (smp.compat)")
smdistributed.modelparallel = modelparallel
