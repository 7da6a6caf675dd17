"""Counter-based random numbers from keys (see :mod:`sgraph._src.random`)."""

from ._src.random import bernoulli, bits, dropout, fold_in, key, normal, split, uniform

__all__ = ["bernoulli", "bits", "dropout", "fold_in", "key", "normal", "split", "uniform"]
