"""SMP v1's ``patches.checkpoint`` import path: smp.v1.patches."""

from smp.v1.patches import *  # noqa: F403
from smp.v1.patches import __all__  # noqa: F401
