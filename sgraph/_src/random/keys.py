"""Making keys and deriving new ones: key, split, fold_in."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ArgumentError, ArgumentTypeError
from .checks import check_key, describe, is_int
from .threefry import FOLD_TAG, MASK, SPLIT_TAG, Word, threefry2x32

__all__ = ["key", "split", "fold_in"]

_U64 = 2**64 - 1


def key(seed: int, *, device: torch.device | str | None = None) -> Tensor:
    """Make a key from an integer seed.

    Args:
        seed: an int in [-2**63, 2**64); taken modulo 2**64, its high and low 32
            bits are the two words of the key.
        device: where the key, and everything drawn from it, lives.

    Returns:
        An int64 tensor of shape ``(2,)``: an opaque value to thread through state.

    Example:
        >>> k = sg.random.key(0, device="cuda")
        >>> x = sg.random.normal(k, (3,))
    """
    if not is_int(seed) or not -(2**63) <= seed <= _U64:
        raise ArgumentTypeError(
            f"sg.random.key: seed must be an int in [-2**63, 2**64); found {describe(seed)}; "
            "pass a Python int, or derive keys from a tensor with sg.random.fold_in"
        )
    seed &= _U64
    return torch.tensor([seed >> 32, seed & MASK], dtype=torch.int64, device=device)


def split(key: Tensor, num: int = 2) -> Tensor:
    """Derive ``num`` new independent keys from one.

    Args:
        key: the parent key; do not draw from it afterwards.
        num: how many keys to make, at least 1.

    Returns:
        An int64 tensor of shape ``(num, 2)`` on the key's device; index it to get
        each key. The first ``m`` rows do not depend on ``num``.

    Example:
        >>> k, sub = sg.random.split(k)
        >>> noise = sg.random.normal(sub, (8,))
    """
    key = check_key("split", key)
    if not is_int(num) or num < 1:
        raise ArgumentError(f"sg.random.split: num must be an int >= 1; found {describe(num)}; pass e.g. num=2")
    index = torch.arange(num, dtype=torch.int64, device=key.device)
    return torch.stack(threefry2x32(key[0], key[1], SPLIT_TAG, index), dim=-1)


def _data_words(data: object, device: torch.device) -> tuple[Word, Word]:
    if is_int(data) and -(2**63) <= data <= _U64:
        data &= _U64
        return data >> 32, data & MASK
    if isinstance(data, Tensor) and data.ndim == 0 and _is_integer_dtype(data.dtype):
        data = data.to(device=device, dtype=torch.int64)
        high = torch.bitwise_right_shift(data, 32)  # not >>: see threefry._rotl
        return high & MASK, data & MASK  # two's complement, as for ints
    raise ArgumentTypeError(
        "sg.random.fold_in: data must be an int in [-2**63, 2**64) or a 0-d integer "
        f"tensor; found {describe(data)}; pass e.g. the step counter"
    )


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def fold_in(key: Tensor, data: int | Tensor) -> Tensor:
    """Derive a new key from a key and a 64-bit integer, such as a step or a rank.

    Args:
        key: the parent key.
        data: an int, or a 0-d integer tensor; a tensor is traced, so folding in a
            step tensor gives a fresh key at every replay of a captured graph.

    Returns:
        A new key, an int64 tensor of shape ``(2,)``. An int and an equal tensor
        give the same key.

    Example:
        >>> step_key = sg.random.fold_in(k, step)
    """
    key = check_key("fold_in", key)
    hi, lo = _data_words(data, key.device)
    fold_key = threefry2x32(key[0], key[1], FOLD_TAG, 0)
    return torch.stack(threefry2x32(*fold_key, hi, lo))
