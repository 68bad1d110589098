"""SMP v1's compatibility surface: modules that exist so that v1 scripts load and port by
changing their import. Each is re-exported at its v1 import path (``smp.compat``,
``smp.state_mod``, ``smp.optimizers``, ``smp.utils``, ``smp.patches.checkpoint``,
``smp.test.torch.utils``)."""
