# removed once smp/model.py imports from smp.partitioning
from smp.partitioning.plan import *  # noqa: F403
from smp.partitioning.plan import build_plan  # noqa: F401
from smp.partitioning.trace import *  # noqa: F403
from smp.partitioning.trace import trace_modules  # noqa: F401
