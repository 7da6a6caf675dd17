"""Learning-rate schedules made of tensor ops, so a changing rate never retraces.

A schedule maps a count to a 0-dim float32 tensor on the count's device. The count
is the number of updates already applied: the k-th update (k = 1, 2, ...) uses
``schedule(k - 1)``, as in optax, so ``schedule(0)`` is the first rate used. Values
are computed in float64 and rounded once to float32. A Python int is accepted too,
for inspection (``sched(100)`` returns a CPU tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Union

import torch

from ..errors import ArgumentError
from ._checks import check_nonnegative, check_steps

__all__ = ["Schedule", "Count", "constant", "linear", "linear_warmup", "cosine", "warmup_cosine"]

Count = Union[torch.Tensor, int]


class Schedule(Protocol):
    """A callable ``count -> 0-dim float32 tensor`` built only from tensor ops."""

    def __call__(self, count: Count, /) -> torch.Tensor: ...


def _as_float64(count: Count) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        return count.to(torch.float64)
    return torch.as_tensor(count, dtype=torch.float64)


def _ramp(x: torch.Tensor, steps: int) -> torch.Tensor:
    """``clamp(x / steps, 0, 1)``, with 0 steps meaning already done."""
    if steps == 0:
        return torch.ones_like(x)
    return torch.clamp(x / steps, 0.0, 1.0)


def _linear(x: torch.Tensor, init: float, end: float, steps: int) -> torch.Tensor:
    """optax's ``linear_schedule``: ``(init - end) * (1 - frac) + end``, exact at both ends."""
    return (init - end) * (1.0 - _ramp(x, steps)) + end


def _cosine(x: torch.Tensor, init: float, end: float, steps: int) -> torch.Tensor:
    """Half a cosine from ``init`` down to ``end`` over ``steps``, then ``end``."""
    decay = 0.5 * (1.0 + torch.cos(math.pi * _ramp(x, steps)))
    return (init - end) * decay + end


@dataclass(frozen=True)
class _Constant:
    value: float

    def __call__(self, count: Count, /) -> torch.Tensor:
        return torch.full_like(_as_float64(count), self.value, dtype=torch.float32)


@dataclass(frozen=True)
class _Linear:
    init: float
    end: float
    steps: int

    def __call__(self, count: Count, /) -> torch.Tensor:
        return _linear(_as_float64(count), self.init, self.end, self.steps).to(torch.float32)


@dataclass(frozen=True)
class _Cosine:
    init: float
    decay_steps: int
    alpha: float

    def __call__(self, count: Count, /) -> torch.Tensor:
        end = self.init * self.alpha
        return _cosine(_as_float64(count), self.init, end, self.decay_steps).to(torch.float32)


@dataclass(frozen=True)
class _WarmupCosine:
    peak: float
    warmup_steps: int
    total_steps: int
    init: float
    end: float

    def __call__(self, count: Count, /) -> torch.Tensor:
        x = _as_float64(count)
        warm = _linear(x, self.init, self.peak, self.warmup_steps)
        decay = _cosine(x - self.warmup_steps, self.peak, self.end, self.total_steps - self.warmup_steps)
        return torch.where(x < self.warmup_steps, warm, decay).to(torch.float32)


def constant(value: float) -> Schedule:
    """A schedule that is ``value`` at every step.

    Args:
        value: the rate, ``>= 0``.

    Returns:
        A :class:`Schedule`.

    Example:
        >>> sg.optim.constant(1e-3)(5)
        tensor(0.0010)
    """
    return _Constant(check_nonnegative("sg.optim.constant", "value", value))


def linear(init: float, end: float, steps: int) -> Schedule:
    """Go linearly from ``init`` (count 0) to ``end`` (count ``steps``), then hold ``end``.

    Args:
        init: the value at count 0.
        end: the value from count ``steps`` on.
        steps: the length of the ramp, ``>= 0`` (0 means ``end`` from the start).

    Returns:
        A :class:`Schedule`; ``linear(1.0, 0.0, 4)(1)`` is 0.75.

    Example:
        >>> opt = sg.optim.sgd(sg.optim.linear(0.1, 0.0, 1000))
    """
    api = "sg.optim.linear"
    return _Linear(
        check_nonnegative(api, "init", init),
        check_nonnegative(api, "end", end),
        check_steps(api, "steps", steps, minimum=0),
    )


def linear_warmup(peak: float, warmup_steps: int) -> Schedule:
    """Go linearly from 0 (count 0) to ``peak`` (count ``warmup_steps``), then hold ``peak``.

    Args:
        peak: the value reached, ``>= 0``.
        warmup_steps: the length of the ramp, ``>= 0``.

    Returns:
        A :class:`Schedule`; the first update uses 0, as in optax.

    Example:
        >>> sg.optim.linear_warmup(1.0, 4)(2)
        tensor(0.5000)
    """
    api = "sg.optim.linear_warmup"
    peak = check_nonnegative(api, "peak", peak)
    return _Linear(0.0, peak, check_steps(api, "warmup_steps", warmup_steps, minimum=0))


def cosine(init: float, decay_steps: int, *, alpha: float = 0.0) -> Schedule:
    """optax's ``cosine_decay_schedule``: ``init * ((1 - alpha) * c + alpha)``.

    ``c = 0.5 * (1 + cos(pi * min(count, decay_steps) / decay_steps))``, so the value
    falls from ``init`` to ``alpha * init`` at ``decay_steps`` and holds there.

    Args:
        init: the value at count 0, ``>= 0``.
        decay_steps: the length of the decay, ``>= 1``.
        alpha: the final value as a fraction of ``init``, ``>= 0``.

    Returns:
        A :class:`Schedule`.

    Example:
        >>> sg.optim.cosine(1.0, 10)(5)
        tensor(0.5000)
    """
    api = "sg.optim.cosine"
    return _Cosine(
        check_nonnegative(api, "init", init),
        check_steps(api, "decay_steps", decay_steps, minimum=1),
        check_nonnegative(api, "alpha", alpha),
    )


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, *, init: float = 0.0, end: float = 0.0) -> Schedule:
    """Linear warmup from ``init`` to ``peak``, then a cosine down to ``end``.

    The value is ``init`` at count 0, ``peak`` at count ``warmup_steps``, ``end`` at
    count ``total_steps`` and after. Same values as optax's
    ``warmup_cosine_decay_schedule(init, peak, warmup_steps, total_steps, end)``.

    Args:
        peak: the value at the end of warmup, ``>= 0``.
        warmup_steps: the warmup length, in ``[0, total_steps]``.
        total_steps: the count at which ``end`` is reached, warmup included, ``>= 1``.
        init: the value at count 0.
        end: the value from ``total_steps`` on.

    Returns:
        A :class:`Schedule`.

    Example:
        >>> opt = sg.optim.adamw(sg.optim.warmup_cosine(3e-4, 100, 10_000))
    """
    api = "sg.optim.warmup_cosine"
    total = check_steps(api, "total_steps", total_steps, minimum=1)
    warmup = check_steps(api, "warmup_steps", warmup_steps, minimum=0)
    if warmup > total:
        raise ArgumentError(
            f"{api}: warmup_steps must be <= total_steps ({total}); found {warmup}. "
            "total_steps counts the warmup too: pass a larger total_steps or a shorter warmup."
        )
    vals = [check_nonnegative(api, n, v) for n, v in (("peak", peak), ("init", init), ("end", end))]
    return _WarmupCosine(vals[0], warmup, total, vals[1], vals[2])
