"""Refuse cuDNN recurrent layers while a step is traced, saying what works instead.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` on a CUDA device run cuDNN's fused RNN, which
does not trace into an ATen graph: given new weights (as ``sg.functional`` gives it
on every call) the module reads their addresses in ``flatten_parameters`` and may
repack them in place, and the cuDNN op records raw storages ``make_fx`` cannot
hold. Without this guard the trace dies on one of those, far from the user's layer.

The same layers without cuDNN (the native CUDA kernels), and a loop over
``nn.LSTMCell``/``nn.GRUCell``/``nn.RNNCell``, trace and replay like any step, so the
error names those fixes. The check reads ``torch.backends.cudnn`` flags; it never
changes them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .capture import user_source
from .errors import UnsupportedError

__all__ = ["CudnnRnnGuard"]

_LAYERS = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}
_FLATTEN = torch.nn.RNNBase.flatten_parameters.__code__


class CudnnRnnGuard(TorchFunctionMode):
    """Raise :class:`UnsupportedError` where a recurrent layer would take the cuDNN path.

    Push it inside the capture's other torch-function modes, so it sees these calls first.

    Args:
        api: the transform's name, for the message.

    Example:
        >>> with GuardMode(api), CudnnRnnGuard(api), SourceMode(api):
        ...     out = step(*args)
    """

    def __init__(self, api: str) -> None:
        super().__init__()
        self.api = api

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = _cudnn_op(func, args)
        if op is None and getattr(func, "__name__", "") == "data_ptr":
            op = _flattening_op()
        if op is not None:
            self._refuse(op, args[0].device)
        return func(*args, **kwargs)

    def _refuse(self, op: str, device: torch.device) -> None:
        source = user_source()
        where = f" at {source.describe()}" if source is not None else ""
        layer = _LAYERS[op]
        raise UnsupportedError(
            f"{self.api}: nn.{layer} on {device} runs cuDNN's fused RNN (aten.{op}){where}, which "
            "cannot be captured into a graph. Run it without cuDNN: set torch.backends.cudnn.enabled = False "
            f"in your program before the first call (sgraph never changes that flag), or step an nn.{layer}Cell "
            "in a Python loop over time; both capture, and match eager PyTorch on that same path."
        )


def _cudnn_op(func: Callable[..., Any], args: Any) -> str | None:
    """``"lstm"`` (or gru, rnn_tanh, rnn_relu) when ``func`` is that op and cuDNN would run it."""
    owner, _, name = getattr(func, "__qualname__", "").partition(".")
    if owner != "_VariableFunctionsClass" or name not in _LAYERS or not args:
        return None
    x = args[0]
    return name if isinstance(x, torch.Tensor) and torch.backends.cudnn.is_acceptable(x) else None


def _flattening_op(depth: int = 8) -> str | None:
    """The op of the layer whose ``RNNBase.flatten_parameters`` is the caller, else None.

    It reads addresses only when every weight is a CUDA tensor cuDNN accepts."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is _FLATTEN:
            mode = str(getattr(frame.f_locals.get("self"), "mode", "")).lower()
            return mode if mode in _LAYERS else "lstm"
        frame = frame.f_back
    return None
