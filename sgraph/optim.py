"""Optax-like pure optimizers and schedules (see :mod:`sgraph._src.optim`)."""

from ._src.optim import *  # noqa: F403  (the public names are the private package's __all__)
from ._src.optim import __all__ as __all__
