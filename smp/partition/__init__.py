"""The tracer and the partitioner: which stage owns each module."""
