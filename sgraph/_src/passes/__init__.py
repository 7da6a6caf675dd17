"""Graph passes: each a function ``Program -> Program`` in its own module."""
