"""Tensor parallelism: the collectives and shard layouts (functional), the regions that run a
distributed module's forward on every tensor-parallel rank (region), the distributed modules
(modules, lm_head), and the registry that replaces a user's modules with them (registry).
``smp.nn`` is the public face of this package."""
