"""Data parallelism: the gradient reduction over the data-parallel group and sharded data
parallelism on FSDP2."""
