"""Short reprs of optimizer states, for notebooks and logs.

A state's fields are trees of thousands of tensors; printing them buries what a
reader wants: which state, at which step, holding what. ``state_repr`` says that:

    ScaleByAdamState(count=3, mu=<12 tensors, f32, 1.2M elements>, nu=<...>)

The count is read as a number only from a plain 0-dim CPU tensor outside any
tracing (reading a CUDA tensor would wait for the device); otherwise it is
described, ``count=<i64 on cuda:0>``. Trees of up to three tensors list their shapes.
"""

from __future__ import annotations

import html
from typing import Any

import torch

from .. import tree
from ..text import short_dtype

__all__ = ["state_repr", "state_html"]

_SHAPES_SHOWN = 3
_ROWS_SHOWN = 50


def _dtype(dtype: torch.dtype) -> str:
    return short_dtype(dtype)


def _amount(n: int) -> str:
    """``35``, ``1.2K``, ``3.4M``, ``5.6B``: an element count at a glance."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _readable(t: torch.Tensor) -> bool:
    """Whether ``t.item()`` is free: a plain 0-dim CPU tensor, with nothing tracing it."""
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dim() != 0:
        return False
    return torch._C._len_torch_dispatch_stack() == 0 and not torch.compiler.is_compiling()


def _scalar(t: torch.Tensor) -> str:
    if _readable(t):
        return repr(t.item())
    return f"<{_dtype(t.dtype)} on {t.device}>"


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _tree(value: Any) -> str:
    """``<n tensors, dtypes, elements[ on devices][: shapes]>``."""
    leaves = [x for x in tree.leaves(value) if isinstance(x, torch.Tensor)]
    noun = "tensor" if len(leaves) == 1 else "tensors"
    if not leaves:
        return "<0 tensors>"
    dtypes = "/".join(dict.fromkeys(_dtype(x.dtype) for x in leaves))
    numel = sum(x.numel() for x in leaves)
    text = f"<{len(leaves)} {noun}, {dtypes}, {_amount(numel)} element{'s' * (numel != 1)}"
    devices = ", ".join(dict.fromkeys(str(x.device) for x in leaves if x.device.type != "cpu"))
    if devices:
        text += f" on {devices}"
    if len(leaves) <= _SHAPES_SHOWN:
        text += ": " + ", ".join(_shape(x) for x in leaves)
    return text + ">"


def _field(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return _scalar(value)
    return _tree(value)


def state_repr(state: Any) -> str:
    """``Type(field=summary, ...)`` for a state NamedTuple; no tensor's values printed.

    Example:
        >>> sg.optim.adam(1e-3).init({"w": torch.zeros(7, 5)})
        ScaleByAdamState(count=0, mu=<1 tensor, f32, 35 elements: (7, 5)>, nu=<1 tensor, f32, 35 elements: (7, 5)>)
    """
    fields = ", ".join(f"{name}={_field(value)}" for name, value in zip(state._fields, state))
    return f"{type(state).__name__}({fields})"


def _rows(state: Any) -> list[str]:
    """One table row per tensor: path, shape, dtype, device (the first ``_ROWS_SHOWN``)."""
    paths, leaves, _ = tree.flatten_with_paths(state, prefix="state")
    rows = [
        f"<tr><td><code>{html.escape(p)}</code></td><td>{_shape(x)}</td><td>{_dtype(x.dtype)}</td>"
        f"<td>{html.escape(str(x.device))}</td></tr>"
        for p, x in zip(paths[:_ROWS_SHOWN], leaves)
        if isinstance(x, torch.Tensor)
    ]
    if len(paths) > _ROWS_SHOWN:
        rows.append(f"<tr><td colspan='4'>... {len(paths) - _ROWS_SHOWN} more</td></tr>")
    return rows


def state_html(state: Any) -> str:
    """The repr, unfolding in a notebook into a table of the state's tensors."""
    return (
        f"<details><summary><code>{html.escape(state_repr(state))}</code></summary>"
        f"<table>{''.join(_rows(state))}</table></details>"
    )
