"""SMP v1's ``test.torch.utils`` import path: smp.v1.test_utils."""

from smp.v1.test_utils import *  # noqa: F403
from smp.v1.test_utils import __all__  # noqa: F401
