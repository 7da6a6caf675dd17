"""The validated option records of each transform, and of a stack of them.

Options are checked once, when the decorator is applied, into frozen dataclasses;
tracing and cache keys read only these records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from .errors import ArgumentError, ArgumentTypeError

__all__ = ["Options", "StaticOptions", "Retrace", "Fallback", "OutputMode", "check_donate"]

Retrace = Literal["warn", "error", "allow"]
Fallback = Literal["none", "eager"]
OutputMode = Literal["copy", "view"]


@dataclass(frozen=True)
class StaticOptions:
    """Options of ``sg.static``; see its docstring."""

    donate: tuple[str | int, ...] = ()
    retrace: Retrace = "warn"
    fallback: Fallback = "none"
    outputs: OutputMode = "copy"


@dataclass(frozen=True)
class Options:
    """Everything the stacked transforms asked for; one record per transform."""

    static: StaticOptions | None = None
    names: tuple[str, ...] = field(default=())

    def with_static(self, static: StaticOptions) -> Options:
        return replace(self, static=static, names=self.names + ("static",))

    @property
    def effective_static(self) -> StaticOptions:
        return self.static or StaticOptions()


def check_literal(api: str, name: str, value: Any, kind: Any) -> None:
    """Raise ``ValueError`` naming the option when ``value`` is not one of ``kind``'s values."""
    allowed = get_args(kind)
    if value not in allowed:
        raise ArgumentError(f"{api}: {name}={value!r} is not one of {', '.join(repr(a) for a in allowed)}.")


def check_donate(api: str, fn: Callable[..., Any], donate: Any) -> tuple[str | int, ...]:
    """Normalize ``donate`` to a tuple of names/positions that exist in ``fn``'s signature."""
    items: Sequence[Any] = (donate,) if isinstance(donate, (str, int)) else tuple(donate)
    params, var_kw = _parameters(fn)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise ArgumentTypeError(f"{api}: donate entries are argument names or positions; found {item!r}.")
        if isinstance(item, str) and params is not None and item not in params and not var_kw:
            raise ArgumentError(
                f"{api}: donate names {item!r}, which is not a parameter of {_name(fn)}; "
                f"its parameters are {', '.join(params)}."
            )
        if isinstance(item, int) and item < 0:
            raise ArgumentError(f"{api}: donate position {item} is negative; use positions from 0.")
    return tuple(items)


def _parameters(fn: Callable[..., Any]) -> tuple[list[str] | None, bool]:
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, True
    kinds = [p.kind for p in sig.parameters.values()]
    return list(sig.parameters), inspect.Parameter.VAR_KEYWORD in kinds


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
