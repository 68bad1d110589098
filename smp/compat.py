"""SMP v1's ``compat`` import path: smp.v1.compat."""

from smp.v1.compat import *  # noqa: F403
from smp.v1.compat import __all__  # noqa: F401
