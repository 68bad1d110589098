"""SMP v1's ``utils`` import path: smp.v1.utils."""

from smp.v1.utils import *  # noqa: F403
from smp.v1.utils import __all__  # noqa: F401
