"""SMP v1's ``test.torch.utils`` debugging helpers: importable, so that a v1 script that imports
them loads; not built (they fail when called)."""

from smp.core.unbuilt import function

__all__ = ["dump_model", "verify"]

dump_model = function("smp.test.torch.utils.dump_model", "SMP v1's model dump for debugging")
verify = function("smp.test.torch.utils.verify", "SMP v1's debugging comparison")
