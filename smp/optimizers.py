"""SMP v1's ``optimizers`` import path: smp.v1.optimizers."""

from smp.v1.optimizers import *  # noqa: F403
from smp.v1.optimizers import __all__  # noqa: F401
