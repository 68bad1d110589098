"""What every concern of smp shares: how values are flattened (tree) and encoded between
processes (messages), the random streams, the layout of a tensor split over ranks, the step's
timeline, module-creation hooks and the names that are not built yet. Nothing here imports a
concern above it (docs/design.md §0)."""
