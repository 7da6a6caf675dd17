"""sgraph's own kernels, each registered as a torch custom op (one file per kernel)."""
