"""Argument checks shared by the optimizers and schedules.

Construction-time checks raise ``sg.ArgumentError`` / ``sg.ArgumentTypeError`` (a
``ValueError`` / ``TypeError``) naming the function, the argument, what is allowed and
what was found. Update-time checks compare the
trees a caller passes with the state that ``init`` built, so a mismatch names the
first differing path instead of failing inside a foreach kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import tree
from ..errors import ArgumentError, ArgumentTypeError

__all__ = [
    "check_beta",
    "check_nonnegative",
    "check_positive",
    "check_steps",
    "check_learning_rate",
    "check_state",
    "tensor_leaves",
    "matching_leaves",
    "required_params",
]


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(api: str, name: str, allowed: str, value: object, fix: str) -> ArgumentError:
    return ArgumentError(f"{api}: {name} must be {allowed}; found {value!r}. {fix}")


def _real(api: str, name: str, value: object) -> float:
    """``value`` as a finite float, or a ``TypeError``/``ValueError`` naming it."""
    if not _is_real(value):
        raise ArgumentTypeError(f"{api}: {name} must be a Python float; found {type(value).__name__} {value!r}.")
    if not math.isfinite(value):  # type: ignore[arg-type]
        raise _fail(api, name, "finite", value, f"Pass a finite {name}.")
    return float(value)  # type: ignore[arg-type]


def check_beta(api: str, name: str, value: object) -> float:
    """Return ``value`` as a float in ``[0, 1)`` or raise naming ``api`` and ``name``.

    Example:
        >>> check_beta("sg.optim.adam", "b1", 0.9)
        0.9
    """
    beta = _real(api, name, value)
    if not 0.0 <= beta < 1.0:
        raise _fail(api, name, "in [0, 1)", value, f"Pass a decay rate such as {name}=0.9.")
    return beta


def check_nonnegative(api: str, name: str, value: object) -> float:
    """Return ``value`` as a float ``>= 0`` or raise naming ``api`` and ``name``."""
    x = _real(api, name, value)
    if x < 0.0:
        raise _fail(api, name, ">= 0", value, f"Pass {name}=0.0 to turn it off, or a positive value.")
    return x


def check_positive(api: str, name: str, value: object) -> float:
    """Return ``value`` as a float ``> 0`` or raise naming ``api`` and ``name``."""
    x = _real(api, name, value)
    if x <= 0.0:
        raise _fail(api, name, "> 0", value, f"Pass a positive {name}.")
    return x


def check_steps(api: str, name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` as an int ``>= minimum`` or raise naming ``api`` and ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{api}: {name} must be an int; found {type(value).__name__} {value!r}.")
    if value < minimum:
        raise _fail(api, name, f"an int >= {minimum}", value, f"Pass a step count of at least {minimum}.")
    return value


def check_learning_rate(api: str, lr: object) -> Any:
    """Return ``lr`` as a float ``>= 0``, or unchanged if it is a callable schedule.

    Example:
        >>> check_learning_rate("sg.optim.sgd", 1)
        1.0
    """
    if callable(lr):
        return lr
    if not _is_real(lr):
        raise ArgumentTypeError(
            f"{api}: lr must be a float >= 0 or a Schedule (a callable count -> 0-dim tensor, "
            f"e.g. sg.optim.cosine(...)); found {type(lr).__name__}."
        )
    if not (math.isfinite(lr) and lr >= 0.0):  # type: ignore[operator,arg-type]
        allowed = "a finite float >= 0 or a Schedule"
        raise _fail(api, "lr", allowed, lr, "Pass a learning rate such as lr=1e-3.")
    return float(lr)  # type: ignore[arg-type]


def check_state(api: str, state: object, cls: type) -> None:
    """Raise ``TypeError`` unless ``state`` is the ``cls`` that this transform's ``init`` returns."""
    if not isinstance(state, cls):
        raise ArgumentTypeError(
            f"{api} update: state must be the {cls.__name__} returned by init(params) or by the "
            f"previous update; found {type(state).__name__}. Pass this optimizer's own state."
        )


def tensor_leaves(api: str, params: Any) -> tuple[list[torch.Tensor], tree.PyTreeSpec]:
    """Flatten ``params`` for ``init``; every leaf must be a floating-point tensor."""
    paths, leaves, spec = tree.flatten_with_paths(params, prefix="params")
    for path, leaf in zip(paths, leaves):
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
            is_tensor = isinstance(leaf, torch.Tensor)
            found = f"tensor of dtype {leaf.dtype}" if is_tensor else type(leaf).__name__
            raise ArgumentTypeError(
                f"{api} init: {path} must be a floating-point tensor; found {found}. "
                "Keep non-trainable values out of the params tree."
            )
    return leaves, spec


def matching_leaves(api: str, expected: Any, found: Any, *, name: str) -> list[Any]:
    """The leaves of ``found`` after checking it has the structure of ``expected``.

    Raises:
        TreeStructureError: the structures differ; the message names the first
            differing path, written with ``name`` as its root.
    """
    tree.assert_same_structure(expected, found, what=f"{api} update: {name}", prefix=name)
    return tree.leaves(found)


def required_params(api: str, params: Any, grads: Any, *, reason: str) -> list[torch.Tensor]:
    """The leaves of ``params``, which this update needs; raise if they were not passed."""
    if params is None:
        raise ArgumentError(
            f"{api} update: params is None, but {reason} needs the current params. Call update(grads, state, params)."
        )
    return matching_leaves(api, grads, params, name="params")
