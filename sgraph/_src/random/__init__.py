"""Counter-based random numbers from explicit keys, made only of integer tensor ops.

A *key* is an int64 tensor of shape ``(2,)`` holding two 32-bit words. Treat it as
an opaque value: make one with :func:`key`, thread it through your state, derive
new ones with :func:`split` or :func:`fold_in`, and never draw from one key twice.

Every sample is a pure function of (key, counter) through Threefry-2x32 with 20
rounds (Salmon et al. 2011, Random123; the hash JAX uses), built from add mod
2**32, rotate and xor on int64 tensors holding 32-bit values. So the same key gives
the same bits on every device, and there is no generator state, no ``torch.rand*``,
no host sync and no data-dependent shape: the ops trace with ``make_fx``, capture
in a CUDA graph and fuse.

Modules: :mod:`.threefry` (the hash and the counter stream), :mod:`.keys` (key,
split, fold_in), :mod:`.samplers` (bits and distributions), :mod:`.checks`
(argument validation).
"""

from .keys import fold_in, key, split
from .samplers import bernoulli, bits, dropout, normal, uniform
from .threefry import threefry2x32

__all__ = [
    "bernoulli",
    "bits",
    "dropout",
    "fold_in",
    "key",
    "normal",
    "split",
    "threefry2x32",
    "uniform",
]
