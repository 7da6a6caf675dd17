"""``grad`` and ``value_and_grad`` as in JAX, built on ``torch.autograd.grad``.

``torch.func.grad`` does not compose with DTensor leaves; ``torch.autograd.grad``
does, and it traces into one ATen graph with the rest of the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import tree
from .dtensors import for_compute, like
from .errors import ArgumentError, ArgumentTypeError, CaptureError

__all__ = ["grad", "value_and_grad"]

ArgNums = int | Sequence[int]


def value_and_grad(
    fun: Callable[..., Any], /, *, argnums: ArgNums = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Wrap ``fun`` so it returns its value and its gradient w.r.t. some arguments.

    Args:
        fun: returns a floating-point tensor of one element, a scalar (or ``(value, aux)``
            with ``has_aux``).
        argnums: position, or tuple of positions, of the pytree arguments to
            differentiate; their floating-point tensor leaves get gradients.
        has_aux: ``fun`` returns ``(value, aux)``; aux is passed through, detached.

    Returns:
        A function with ``fun``'s signature returning ``(value, grads)`` or
        ``((value, aux), grads)``; ``grads`` has the structure of the selected
        argument (a tuple of them when ``argnums`` is a tuple).

    Example:
        >>> loss, grads = sg.value_and_grad(loss_fn)(params, batch)
    """
    nums = _check_argnums(fun, argnums)
    _check_has_aux(fun, has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return _value_and_grad(fun, nums, isinstance(argnums, int), has_aux, args, kwargs)

    return wrapped


def grad(fun: Callable[..., Any], /, *, argnums: ArgNums = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Wrap ``fun`` so it returns its gradient (and aux) instead of its value.

    Same arguments as :func:`value_and_grad`; returns ``grads`` or ``(grads, aux)``.

    Example:
        >>> grads = sg.grad(loss_fn)(params, batch)
    """
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _check_argnums(fun: Callable[..., Any], argnums: ArgNums) -> tuple[int, ...]:
    if isinstance(argnums, bool) or not isinstance(argnums, (int, tuple, list)):
        raise ArgumentTypeError(
            f"sg.grad({_name(fun)}): argnums must be an int or a tuple of ints; found {argnums!r}. "
            "For example argnums=0 or argnums=(0, 1)."
        )
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nums):
        raise ArgumentError(
            f"sg.grad({_name(fun)}): argnums must be a non-negative int or a non-empty tuple of them; "
            f"found {argnums!r}."
        )
    if len(set(nums)) != len(nums):
        raise ArgumentError(f"sg.grad({_name(fun)}): argnums must not repeat a position; found {argnums!r}.")
    return nums


def _check_has_aux(fun: Callable[..., Any], has_aux: Any) -> None:
    if not isinstance(has_aux, bool):
        raise ArgumentTypeError(f"sg.grad({_name(fun)}): has_aux must be True or False; found {has_aux!r}.")


def _value_and_grad(
    fun: Callable[..., Any],
    nums: tuple[int, ...],
    single: bool,
    has_aux: bool,
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    if max(nums) >= len(args):
        raise ArgumentTypeError(
            f"sg.grad({_name(fun)}): argnums={nums} but only {len(args)} positional arguments were "
            "passed; pass the differentiated arguments positionally."
        )
    if torch.is_inference_mode_enabled():
        # Autograd records nothing in inference mode: differentiate outside it, as
        # torch.func.grad does, on normal copies of the inference tensors among the arguments.
        with torch.inference_mode(False):
            args, kwargs = tree.map(_normal, (list(args), kwargs))
            return _value_and_grad(fun, nums, single, has_aux, args, kwargs)
    args = list(args)
    inputs, specs = [], []
    outer = any(isinstance(x, torch.Tensor) and x.requires_grad for n in nums for x in tree.leaves(args[n]))
    for n in nums:
        leaves, spec = tree.flatten(args[n])
        watched = [_watch(leaf, fun, n, i, spec) for i, leaf in enumerate(leaves)]
        inputs.append(watched)
        specs.append(spec)
        args[n] = tree.unflatten(spec, [for_compute(a, b) for a, b in zip(leaves, watched)])
    flat = [leaf for leaves in inputs for leaf in leaves]
    _check_devices_present(fun, flat)  # before the forward: autograd records it on the device
    create_graph = outer  # an outer sg.grad differentiates through this one
    with torch.enable_grad():  # gradients even under an outer torch.no_grad(), as torch.func.grad
        out = fun(*args, **kwargs)
        value, aux = _split_aux(fun, out, has_aux)
        grads = [like(g, x) for g, x in zip(_autograd(value, flat, create_graph), flat)]
    grads_trees, start = [], 0
    for leaves, spec in zip(inputs, specs):
        grads_trees.append(tree.unflatten(spec, grads[start : start + len(leaves)]))
        start += len(leaves)
    result = grads_trees[0] if single else tuple(grads_trees)
    value = value if create_graph else value.detach()
    if has_aux:
        return (value, tree.map(_detach, aux)), result
    return value, result


def _normal(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) and leaf.is_inference() else leaf


def _watch(leaf: Any, fun: Callable[..., Any], argnum: int, index: int, spec: tree.PyTreeSpec) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if not (leaf.is_floating_point() or leaf.is_complex()):
        path = tree.paths(spec, prefix=f"args[{argnum}]")[index]
        raise ArgumentTypeError(
            f"sg.grad({_name(fun)}): {path} has dtype {_dtype(leaf)}; gradients need floating-point "
            "leaves. Move integer tensors to an argument not listed in argnums."
        )
    if leaf.requires_grad:
        # An outer sg.grad is differentiating through us: stay connected to its graph.
        return leaf.view_as(leaf)
    return leaf.detach().requires_grad_(True)


def _split_aux(fun: Callable[..., Any], out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ArgumentTypeError(
                f"sg.grad({_name(fun)}, has_aux=True): the function must return (value, aux); "
                f"found {type(out).__name__}."
            )
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        found = (
            f"a {_dtype(value)} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        hint = " Pass has_aux=True to return (value, aux)." if isinstance(out, tuple) and not has_aux else ""
        raise ArgumentTypeError(
            f"sg.grad({_name(fun)}): the function must return a floating-point scalar tensor; found {found}.{hint}"
        )
    return value, aux


def _check_devices_present(fun: Callable[..., Any], inputs: list[Any]) -> None:
    """Tensors of a device this machine lacks (fake CUDA tensors, traced on a CPU-only
    machine to analyse a step) cannot be differentiated: torch's autograd engine sets
    the device up even for them, and a CPU-only torch aborts the process there."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    for device in dict.fromkeys(x.device for x in tensors):
        backend = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
        available = getattr(backend, "is_available", None)
        if available is not None and not available():
            raise CaptureError(
                f"sg.grad({_name(fun)}): differentiates tensors on {device}, which this machine does not "
                f"have (torch's autograd engine sets the device up even for fake tensors). Trace the step "
                "on a machine with that device, or analyse it with tensors of the same shapes on the CPU "
                "(fake tensors under torch's FakeTensorMode allocate nothing; the device's own "
                "workspaces are then not counted)."
            )


def _autograd(value: torch.Tensor, inputs: list[Any], create_graph: bool) -> list[Any]:
    tensors = [(i, x) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    grads: list[Any] = [None] * len(inputs)
    if not tensors:
        return grads
    found: Sequence[torch.Tensor]
    if not value.requires_grad:
        found = [torch.zeros_like(x) for _, x in tensors]
    else:
        found = torch.autograd.grad(
            value.reshape(()), [x for _, x in tensors], allow_unused=True, create_graph=create_graph
        )
    for (i, x), g in zip(tensors, found):
        grads[i] = torch.zeros_like(x) if g is None else g
    return grads


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _name(fun: Callable[..., Any]) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__name__
