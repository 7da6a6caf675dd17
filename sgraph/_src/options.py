"""The validated option records of each transform, and of a stack of them.

Options are checked once, when the decorator is applied, into frozen dataclasses;
tracing and cache keys read only these records.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from .errors import ArgumentError, ArgumentTypeError

__all__ = [
    "Options",
    "StaticOptions",
    "FuseOptions",
    "MemoryOptions",
    "MemoryPolicy",
    "check_budget",
    "check_patterns",
    "OWN_KERNELS",
    "check_kernels",
    "Retrace",
    "Fallback",
    "OutputMode",
    "check_donate",
    "check_literal",
    "check_unknown",
]

Retrace = Literal["warn", "error", "allow"]
Fallback = Literal["none", "eager"]
OutputMode = Literal["copy", "view"]

MemoryPolicy = Literal["min_time", "save_matmuls", "save_block_inputs"]

OWN_KERNELS = ("linear_cross_entropy", "adamw", "gelu_mlp")
"""The own kernels ``sg.fuse`` can substitute for patterns of ATen ops."""


@dataclass(frozen=True)
class StaticOptions:
    """Options of ``sg.static``; see its docstring."""

    donate: tuple[str | int, ...] = ()
    retrace: Retrace = "warn"
    fallback: Fallback = "none"
    outputs: OutputMode = "copy"


@dataclass(frozen=True)
class FuseOptions:
    """Options of ``sg.fuse``; see its docstring."""

    autotune: bool = False
    kernels: tuple[str, ...] = OWN_KERNELS
    reuse_blocks: bool = True
    channels_last: bool = True


@dataclass(frozen=True)
class MemoryOptions:
    """Options of ``sg.plan_memory``; see its docstring. ``budget`` is bytes (int) or a
    fraction of device memory (float), resolved when the step is lowered."""

    budget: int | float | None = None
    policy: MemoryPolicy = "min_time"
    save: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    blocks: str | None = None


@dataclass(frozen=True)
class Options:
    """Everything the stacked transforms asked for; one record per transform."""

    static: StaticOptions | None = None
    fuse: FuseOptions | None = None
    memory: MemoryOptions | None = None
    shard: Any = None  # a placing.ShardOptions
    names: tuple[str, ...] = field(default=())

    def with_static(self, static: StaticOptions) -> Options:
        return replace(self, static=static, names=self.names + ("static",))

    def with_fuse(self, fuse: FuseOptions) -> Options:
        return replace(self, fuse=fuse, names=self.names + ("fuse",))

    def with_memory(self, memory: MemoryOptions) -> Options:
        return replace(self, memory=memory, names=self.names + ("plan_memory",))

    def with_shard(self, shard: Any) -> Options:
        return replace(self, shard=shard, names=self.names + ("shard",))

    @property
    def effective_static(self) -> StaticOptions:
        return self.static or StaticOptions()


def check_literal(api: str, name: str, value: Any, kind: Any) -> None:
    """Raise ``ValueError`` naming the option when ``value`` is not one of ``kind``'s values."""
    allowed = get_args(kind)
    if value not in allowed:
        raise ArgumentError(f"{api}: {name}={value!r} is not one of {', '.join(repr(a) for a in allowed)}.")


def check_kernels(api: str, kernels: Any) -> tuple[str, ...]:
    """Normalize ``kernels`` (``"all"``, a name, or a sequence of names) to a tuple of known names."""
    if kernels == "all":
        return OWN_KERNELS
    items = (kernels,) if isinstance(kernels, str) else kernels
    if not isinstance(items, (tuple, list)) or not all(isinstance(k, str) for k in items):
        raise ArgumentTypeError(
            f'{api}: kernels must be "all", a kernel name or a tuple of them; found {kernels!r}. '
            f"The own kernels are {', '.join(OWN_KERNELS)}; kernels=() turns them all off."
        )
    for name in items:
        if name not in OWN_KERNELS:
            close = difflib.get_close_matches(name, OWN_KERNELS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ArgumentError(
                f"{api}: kernels names {name!r}, which is not an own kernel of sg.fuse; they are "
                f"{', '.join(OWN_KERNELS)}.{hint}"
            )
    return tuple(dict.fromkeys(items))


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*$")


def check_budget(api: str, budget: Any) -> int | float | None:
    """Normalize a memory budget: bytes (int), a size string (``"40GiB"``, ``"512MB"``),
    or a fraction of device memory (a float in (0, 1]); ``None`` for no budget."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ArgumentTypeError(
            f'{api}: budget must be bytes (an int), a size such as "40GiB", or a fraction of device '
            f"memory such as 0.8; found {budget!r}."
        )
    if isinstance(budget, str):
        match = _SIZE.match(budget)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ArgumentError(
                f'{api}: budget={budget!r} is not a size; write a number and a unit, e.g. "40GiB", '
                '"512MiB" or "1.5GB" (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).'
            )
        budget = int(float(match.group(1)) * _UNITS[unit])
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ArgumentError(
            f"{api}: budget={budget!r}: a float budget is a fraction of device memory, in (0, 1]; give "
            'bytes as an int or a string such as "40GiB".'
        )
    if budget <= 0:
        raise ArgumentError(f"{api}: budget={budget!r} must be positive.")
    return budget


def check_patterns(api: str, name: str, patterns: Any) -> tuple[str, ...]:
    """Normalize patterns of module paths or tags (a string or a sequence of strings) to a tuple."""
    items = (patterns,) if isinstance(patterns, str) else patterns
    if not isinstance(items, (tuple, list)) or not all(isinstance(p, str) and p for p in items):
        raise ArgumentTypeError(
            f"{api}: {name} must be a pattern of module paths or tags, or a tuple of them, such as "
            f'"blocks.*.attn" or ("blocks.0.*", "attn_scores"); found {patterns!r}.'
        )
    return tuple(items)


def check_unknown(api: str, unknown: dict[str, Any], known: Sequence[str]) -> None:
    """Raise naming an option the transform does not have, with the closest known one."""
    if not unknown:
        return
    name = next(iter(unknown))
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]}=?" if close else ""
    raise ArgumentTypeError(
        f"{api}: unknown option {name}={unknown[name]!r}; its options are {', '.join(known)}.{hint}"
    )


def check_donate(api: str, fn: Callable[..., Any], donate: Any) -> tuple[str | int, ...]:
    """Normalize ``donate`` to a tuple of names/positions that exist in ``fn``'s signature."""
    if isinstance(donate, (str, int)) and not isinstance(donate, bool):
        items: Sequence[Any] = (donate,)
    elif isinstance(donate, (tuple, list)):
        items = tuple(donate)
    else:
        raise ArgumentTypeError(
            f"{api}: donate must be an argument name, a position, or a tuple of them; found {donate!r}. "
            'For example donate=("params", "opt_state") or donate=0.'
        )
    params, var_kw, positional, var_pos = _parameters(fn)
    for item in items:
        _check_donate_item(api, fn, item, params, var_kw, positional, var_pos)
    return tuple(items)


def _check_donate_item(
    api: str,
    fn: Callable[..., Any],
    item: Any,
    params: list[str] | None,
    var_kw: bool,
    positional: int,
    var_pos: bool,
) -> None:
    if isinstance(item, bool) or not isinstance(item, (str, int)):
        raise ArgumentTypeError(f"{api}: donate entries are argument names or positions; found {item!r}.")
    if isinstance(item, str) and params is not None and item not in params and not var_kw:
        raise ArgumentError(
            f"{api}: donate names {item!r}, which is not a parameter of {_name(fn)}; "
            f"its parameters are {', '.join(params)}."
        )
    if isinstance(item, int) and item < 0:
        raise ArgumentError(f"{api}: donate position {item} is negative; use positions from 0.")
    if isinstance(item, int) and params is not None and not var_pos and item >= positional:
        raise ArgumentError(
            f"{api}: donate position {item} is beyond the {positional} positional parameter(s) of "
            f"{_name(fn)} ({', '.join(params[:positional]) or 'none'}); positions count from 0."
        )


def _parameters(fn: Callable[..., Any]) -> tuple[list[str] | None, bool, int, bool]:
    """Parameter names, whether there is ``**kwargs``, how many positional ones, whether ``*args``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, True, 0, True
    kinds = [p.kind for p in sig.parameters.values()]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    return (
        list(sig.parameters),
        inspect.Parameter.VAR_KEYWORD in kinds,
        positional,
        inspect.Parameter.VAR_POSITIONAL in kinds,
    )


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
