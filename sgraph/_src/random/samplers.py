"""Drawing from a key: bits and the uniform, normal and Bernoulli distributions.

Bits become floats exactly: float32 (and bfloat16/float16, drawn in float32) take
the top 24 bits of a word times 2**-24; float64 joins 27 + 26 bits of two words
times 2**-53. Normals use Box-Muller on pairs of words.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ArgumentError, ArgumentTypeError
from .checks import (
    Shape,
    check_bounds,
    check_float_dtype,
    check_key,
    check_probability,
    check_probability_tensor,
    check_shape,
    describe,
)
from .threefry import stream

__all__ = ["bits", "uniform", "normal", "bernoulli", "dropout"]


def bits(key: Tensor, shape: Shape) -> Tensor:
    """Draw uniformly random 32-bit words.

    Args:
        key: the key to draw from.
        shape: the output shape, an int or a sequence of ints.

    Returns:
        An int64 tensor of ``shape`` with values in [0, 2**32), on the key's device;
        the same on every device.

    Example:
        >>> sg.random.bits(sg.random.key(0), 2).tolist()
        [1797259609, 2579123966]
    """
    key = check_key("bits", key)
    dims = check_shape("bits", shape)
    return stream(key, math.prod(dims)).reshape(dims)


def unit24(words: Tensor) -> Tensor:
    """The top 24 bits of 32-bit words as float32 in [0, 1 - 2**-24], exactly."""
    return torch.bitwise_right_shift(words, 8).to(torch.float32) * 2.0**-24  # not >> (see threefry._rotl)


def unit53(w0: Tensor, w1: Tensor) -> Tensor:
    """Two 32-bit words as one float64 in [0, 1 - 2**-53], exactly."""
    high = torch.bitwise_left_shift(torch.bitwise_right_shift(w0, 5), 26)  # not >> / << (see threefry._rotl)
    return (high | torch.bitwise_right_shift(w1, 6)).to(torch.float64) * 2.0**-53


def box_muller(w0: Tensor, w1: Tensor, compute: torch.dtype) -> Tensor:
    """Two standard normals per pair of 32-bit words, finite for every input.

    The radius uses ``(w0 + 0.5) / 2**32`` in (0, 1], so ``log`` never sees 0 and
    ``|z| <= sqrt(2 ln 2**33) < 6.8``.
    """
    radius = torch.sqrt(-2.0 * torch.log((w0.to(compute) + 0.5) * 2.0**-32))
    theta = w1.to(compute) * (2.0 * math.pi * 2.0**-32)
    return torch.stack((radius * torch.cos(theta), radius * torch.sin(theta)), dim=-1)


def _unit(key: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Floats in [0, 1): float64 for float64, else float32."""
    n = math.prod(shape)
    if dtype == torch.float64:
        w = stream(key, 2 * n).reshape(n, 2)
        return unit53(w[:, 0], w[:, 1]).reshape(shape)
    return unit24(stream(key, n)).reshape(shape)


def uniform(
    key: Tensor,
    shape: Shape,
    *,
    dtype: torch.dtype = torch.float32,
    minval: float = 0.0,
    maxval: float = 1.0,
) -> Tensor:
    """Draw floats uniformly from [minval, maxval).

    Low-precision dtypes are drawn in float32 and rounded; a value that would round
    up to ``maxval`` becomes the largest ``dtype`` value below it.

    Args:
        key: the key to draw from.
        shape: the output shape, an int or a sequence of ints.
        dtype: a floating dtype.
        minval: the inclusive lower bound.
        maxval: the exclusive upper bound, greater than ``minval``.

    Returns:
        A tensor of ``shape`` and ``dtype`` on the key's device; in eager mode the
        same on every device.

    Example:
        >>> w = sg.random.uniform(k, (4, 4), minval=-0.1, maxval=0.1)
    """
    key = check_key("uniform", key)
    dims = check_shape("uniform", shape)
    dtype = check_float_dtype("uniform", dtype)
    minval, maxval = check_bounds("uniform", minval, maxval)
    u = _unit(key, dims, dtype)
    if (minval, maxval) != (0.0, 1.0):
        u = u * (maxval - minval) + minval
    top = torch.full((), maxval, dtype=dtype, device=key.device)
    below = torch.nextafter(top, torch.full_like(top, -math.inf))
    return torch.clamp(u.to(dtype), min=minval).minimum(below)


def normal(key: Tensor, shape: Shape, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Draw standard normal floats (mean 0, variance 1) by the Box-Muller transform.

    Computed in float32 (float64 for float64) from 32-bit words and rounded to
    ``dtype``; always finite, ``|x| < 6.8``. Devices agree up to the rounding of
    their ``log``, ``cos`` and ``sin``.

    Args:
        key: the key to draw from.
        shape: the output shape, an int or a sequence of ints.
        dtype: a floating dtype.

    Returns:
        A tensor of ``shape`` and ``dtype`` on the key's device.

    Example:
        >>> eps = sg.random.normal(k, (16, 8), dtype=torch.bfloat16)
    """
    key = check_key("normal", key)
    dims = check_shape("normal", shape)
    dtype = check_float_dtype("normal", dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    n = math.prod(dims)
    w = stream(key, 2 * ((n + 1) // 2)).reshape(-1, 2)
    z = box_muller(w[:, 0], w[:, 1], compute)
    return z.reshape(-1)[:n].reshape(dims).to(dtype)


def bernoulli(key: Tensor, p: float | Tensor = 0.5, shape: Shape | None = None) -> Tensor:
    """Draw booleans that are True with probability ``p``.

    Args:
        key: the key to draw from.
        p: the probability: a number in [0, 1], or a floating tensor on the key's
            device that broadcasts to ``shape`` (its values are not checked, as
            that would need a host sync).
        shape: the output shape; defaults to ``p.shape`` for a tensor, else ``()``.

    Returns:
        A bool tensor of ``shape`` on the key's device.

    Example:
        >>> keep = sg.random.bernoulli(k, 0.9, (128,))
    """
    key = check_key("bernoulli", key)
    if isinstance(p, Tensor):
        dims = tuple(p.shape) if shape is None else check_shape("bernoulli", shape)
        return _unit(key, dims, torch.float32) < check_probability_tensor("bernoulli", p, dims)
    dims = check_shape("bernoulli", () if shape is None else shape)
    return _unit(key, dims, torch.float32) < check_probability("bernoulli", p)


def dropout(key: Tensor, x: Tensor, p: float, *, training: bool = True) -> Tensor:
    """Zero each entry of ``x`` with probability ``p`` and scale the rest by 1/(1-p).

    Args:
        key: the key to draw the mask from, on ``x``'s device.
        x: a floating tensor.
        p: the drop probability, a number in [0, 1].
        training: when False, return ``x`` unchanged.

    Returns:
        ``x * mask / (1 - p)`` in ``x``'s dtype, with dropped entries exactly 0
        (even where ``x`` is inf or nan); ``x`` itself when ``p == 0`` or not
        training; zeros when ``p == 1``.

    Example:
        >>> h = sg.random.dropout(k, h, 0.1, training=is_training)
    """
    key = check_key("dropout", key)
    rate = check_probability("dropout", p)
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise ArgumentTypeError(
            f"sg.random.dropout: x must be a floating tensor; found {describe(x)}; cast it with x.float()"
        )
    if x.device != key.device:
        raise ArgumentError(
            f"sg.random.dropout: key and x must be on one device; found key on {key.device} "
            f"and x on {x.device}; make the key with sg.random.key(seed, device=x.device)"
        )
    if rate == 0.0 or not training:
        return x
    if rate == 1.0:
        return torch.zeros_like(x)
    keep = _unit(key, tuple(x.shape), torch.float32) >= rate
    return torch.where(keep, x / (1.0 - rate), torch.zeros((), dtype=x.dtype, device=x.device))
