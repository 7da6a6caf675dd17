"""Threefry-2x32-20 on int64 tensors holding 32-bit words, and the counter stream.

Counters are 64-bit numbers ``(hi, lo)``. :func:`stream` (used by every sampler)
hashes counters ``0, 1, ...``; ``split`` uses ``(SPLIT_TAG, i)`` and ``fold_in``
hashes its data under a key derived with ``(FOLD_TAG, 0)``. The three never share
a counter unless one call draws more than 2**64 - 2**33 words.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MASK", "SPLIT_TAG", "FOLD_TAG", "Word", "threefry2x32", "stream"]

MASK = 0xFFFFFFFF
SPLIT_TAG = 0xFFFFFFFF
FOLD_TAG = 0xFFFFFFFE
_PARITY = 0x1BD11BDA  # Threefry key-schedule constant (from Skein)
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)  # Random123 R_32x2 rotation constants

Word = Tensor | int


def _add(a: Word, b: Tensor) -> Tensor:
    # Both operands are below 2**32: the int64 sum cannot overflow, so masking is mod 2**32.
    return (a + b) & MASK


def _rotl(x: Tensor, r: int) -> Tensor:
    # torch.bitwise_*_shift, not ``<<`` / ``>>``: on a DTensor (a key passed to a step under
    # sg.shard) DTensor takes ``aten::__rshift__`` for an in-place op by its name and returns
    # the input unchanged
    return (torch.bitwise_left_shift(x, r) | torch.bitwise_right_shift(x, 32 - r)) & MASK


def threefry2x32(k0: Tensor, k1: Tensor, x0: Word, x1: Word) -> tuple[Tensor, Tensor]:
    """Hash a 64-bit counter under a 64-bit key with Threefry-2x32, 20 rounds.

    Args:
        k0: the first key word, an int64 tensor of values in [0, 2**32).
        k1: the second key word, likewise.
        x0: the first counter word, an int64 tensor or int in [0, 2**32),
            broadcastable with the others.
        x1: the second counter word, likewise.

    Returns:
        The two output words, int64 tensors of values in [0, 2**32) of the
        broadcast shape.

    Example:
        >>> zero = torch.zeros((), dtype=torch.int64)
        >>> [hex(int(w)) for w in threefry2x32(zero, zero, zero, zero)]
        ['0x6b200159', '0x99ba4efe']
    """
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    y0, y1 = _add(x0, ks[0]), _add(x1, ks[1])
    for group in range(5):
        for r in _ROTATIONS[4 * (group % 2) : 4 * (group % 2) + 4]:
            y0 = _add(y0, y1)
            y1 = _rotl(y1, r) ^ y0
        y0 = _add(y0, ks[(group + 1) % 3])
        y1 = _add(y1, _add(group + 1, ks[(group + 2) % 3]))
    y0, y1 = torch.broadcast_tensors(y0, y1)
    return y0, y1


def stream(key: Tensor, n: int) -> Tensor:
    """The first ``n`` words of a key's stream: both outputs of counters 0, 1, ...

    Args:
        key: a key, an int64 tensor of shape ``(2,)`` (not checked here).
        n: how many 32-bit words to make.

    Returns:
        An int64 tensor of shape ``(n,)`` with values in [0, 2**32), on the key's
        device; word ``2 i + j`` is output ``j`` of counter ``i``.

    Example:
        >>> stream(torch.zeros(2, dtype=torch.int64), 2).tolist()
        [1797259609, 2579123966]
    """
    counter = torch.arange((n + 1) // 2, dtype=torch.int64, device=key.device)
    y0, y1 = threefry2x32(key[0], key[1], torch.bitwise_right_shift(counter, 32), counter & MASK)
    return torch.stack((y0, y1), dim=-1).reshape(-1)[:n]
