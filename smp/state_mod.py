"""SMP v1's ``state_mod`` import path: smp.v1.state_mod."""

from smp.v1.state_mod import *  # noqa: F403
from smp.v1.state_mod import __all__  # noqa: F401
