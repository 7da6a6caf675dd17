"""Argument validation for sg.random: each error names the function and argument,
what was expected, what was found, and the fix.

Only Python values, dtypes and shapes are checked, never tensor values: reading
those would need a host sync and would break tracing and CUDA-graph capture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeGuard

import torch
from torch import Tensor

from ..errors import ArgumentError, ArgumentTypeError

__all__ = [
    "Shape",
    "describe",
    "is_int",
    "check_key",
    "check_shape",
    "check_float_dtype",
    "check_probability",
    "check_bounds",
    "check_probability_tensor",
]

Shape = int | Sequence[int]


def describe(x: object) -> str:
    """How an error message shows a found value: dtype and shape for tensors."""
    if isinstance(x, Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"


def is_int(x: object) -> TypeGuard[int]:
    """Whether ``x`` is a Python int (bool excluded)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_key(api: str, key: object) -> Tensor:
    """Return ``key`` if it is an int64 tensor of shape (2,), else raise TypeError."""
    if isinstance(key, Tensor) and key.dtype == torch.int64 and tuple(key.shape) == (2,):
        return key
    fix = "make one with sg.random.key(seed)"
    if isinstance(key, Tensor) and key.ndim == 2 and key.shape[-1] == 2:
        fix = "index the result of split to get one key, e.g. keys[0]"
    raise ArgumentTypeError(
        f"sg.random.{api}: key must be an int64 tensor of shape (2,) made by "
        f"sg.random.key or split; found {describe(key)}; {fix}"
    )


def check_shape(api: str, shape: object) -> tuple[int, ...]:
    """Return ``shape`` (an int or a sequence of non-negative ints) as a tuple."""
    dims = (shape,) if is_int(shape) else shape
    if isinstance(dims, Sequence) and all(is_int(d) and d >= 0 for d in dims):
        return tuple(dims)
    raise ArgumentTypeError(
        f"sg.random.{api}: shape must be an int or a sequence of non-negative ints; "
        f"found {describe(shape)}; pass e.g. (4, 3)"
    )


def check_float_dtype(api: str, dtype: object) -> torch.dtype:
    """Return ``dtype`` if it is a floating torch.dtype, else raise TypeError."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ArgumentTypeError(
        f"sg.random.{api}: dtype must be a floating torch.dtype; found {dtype!r}; "
        "pass e.g. torch.float32 or torch.bfloat16"
    )


def check_probability(api: str, p: object) -> float:
    """Return ``p`` as a float if it is a number in [0, 1], else raise ValueError."""
    if _is_number(p) and 0.0 <= p <= 1.0:
        return float(p)
    raise ArgumentError(
        f"sg.random.{api}: p must be a probability, a number in [0, 1]; found {describe(p)}; pass e.g. p=0.1"
    )


def check_probability_tensor(api: str, p: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Return ``p`` if it is a floating tensor that broadcasts to ``shape``."""
    if not p.dtype.is_floating_point:
        raise ArgumentTypeError(
            f"sg.random.{api}: a tensor p must be floating; found {describe(p)}; cast it with p.float()"
        )
    fits = p.ndim <= len(shape) and all(s in (1, t) for s, t in zip(reversed(p.shape), reversed(shape)))
    if not fits:
        raise ArgumentError(
            f"sg.random.{api}: p of shape {tuple(p.shape)} must broadcast to shape "
            f"{shape}; reshape p or pass a shape that p broadcasts to"
        )
    return p


def check_bounds(api: str, minval: object, maxval: object) -> tuple[float, float]:
    """Return finite ``minval < maxval`` as floats, else raise ValueError."""
    if (
        _is_number(minval)
        and _is_number(maxval)
        and math.isfinite(minval)
        and math.isfinite(maxval)
        and minval < maxval
    ):
        return float(minval), float(maxval)
    raise ArgumentError(
        f"sg.random.{api}: minval and maxval must be finite numbers with minval < maxval; "
        f"found minval={minval!r}, maxval={maxval!r}; pass e.g. minval=-1.0, maxval=1.0"
    )
