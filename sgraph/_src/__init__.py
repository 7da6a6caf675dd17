"""sgraph's private implementation; import from ``sgraph`` instead."""
