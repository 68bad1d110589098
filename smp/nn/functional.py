"""``smp.nn.functional``: the tensor-parallel primitives a distributed module is written with
(docs/guide.md, "Registering your own distributed version of a module"); they live in
smp.tp.functional."""

from smp.tp.functional import *  # noqa: F403
from smp.tp.functional import __all__  # noqa: F401
