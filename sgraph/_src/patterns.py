"""Patterns of ordinary user code that ``sg.fuse`` runs on its own kernels, matched
while the step is traced: a linear map followed by a cross-entropy
(:class:`LinearCrossEntropyMode`), and a transformer's MLP (:class:`GeluMlpMode`).

``F.cross_entropy(x @ W.T, y)`` (or ``F.cross_entropy(head(x).float().view(-1, V),
y.view(-1))``, with ``head`` an ``nn.Linear`` without bias) is matched here, at the
level of the Python calls, where the loss's options (``ignore_index``,
``label_smoothing``, ``reduction``) are plain arguments: the logits' producer is
remembered for every tensor made by a bias-free linear map, and followed through
reshapes and an upcast to fp32 (and not matched if any tensor on that way was written
in place since). The cross-entropy call on such logits then runs
:func:`linear_cross_entropy` instead, whose forward and backward never hold the
full logits. The logits' own matmul, now unused, is dropped from the graph with the
rest of the dead code; if the step uses the logits elsewhere too, they are still
computed for that use, and the result is the same.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .dtensors import is_dtensor
from .kernels.gelu_mlp import gelu_mlp
from .kernels.linear_cross_entropy import linear_cross_entropy

__all__ = ["GELU_MLP_DEVICES", "GeluMlpMode", "LinearCrossEntropyMode", "MIN_CLASSES"]

MIN_CLASSES = 1024
"""Fewer classes than this: the logits are small, the ordinary code is as good."""

_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_TRANSPOSES = {torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__}  # type: ignore[attr-defined]
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_RESHAPES = {
    torch.Tensor.view,
    torch.Tensor.reshape,
    torch.reshape,
    torch.Tensor.flatten,
    torch.flatten,
    torch.Tensor.contiguous,
    torch.Tensor.float,
    torch.Tensor.to,
}


_W = TypeVar("_W", bound="_Watching")


class _Watching:
    """A remembered producer with ``watched``: the tensors on the way with their version
    counters when noted. The own kernels compute from the way's start again, so an
    in-place write to any of them before the pattern completes (``logits.mul_(2)``,
    ``h.mul_(2)``) means the kernel would not compute what the code did."""

    watched: tuple[tuple[torch.Tensor, int], ...]

    def unchanged(self) -> bool:
        """Whether none of the watched tensors was written in place since."""
        return all(t._version == version for t, version in self.watched)

    def through(self: _W, out: torch.Tensor) -> _W:
        """The same producer after the op (a reshape, a cast, the GELU) that made ``out``."""
        return dataclasses.replace(self, watched=self.watched + _watch(out))  # type: ignore[type-var]


@dataclass(frozen=True)
class _Logits(_Watching):
    """Where a tensor of logits came from: ``x @ W.T``, computed in ``dtype`` (the
    autocast dtype, if autocast was on for that matmul). ``weight`` is ``W`` when the
    step named it (``F.linear(x, W)``, ``x @ W.T``); otherwise the matmul's ``right``
    operand is kept and ``W = right.t()`` is taken only once the pattern matches."""

    x: torch.Tensor
    right: torch.Tensor | None
    weight: torch.Tensor | None
    dtype: torch.dtype
    watched: tuple[tuple[torch.Tensor, int], ...]  # from ``x`` to these logits

    def weight_rows(self) -> torch.Tensor:
        """``W``, ``[classes, features]``."""
        if self.weight is not None:
            return self.weight
        assert self.right is not None
        return self.right.t()

    def features_classes(self) -> tuple[int, int]:
        if self.weight is not None:
            return self.weight.shape[1], self.weight.shape[0]
        assert self.right is not None
        return self.right.shape[0], self.right.shape[1]


class LinearCrossEntropyMode(TorchFunctionMode):
    """Active while a step is traced under ``sg.fuse``; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        # Keyed by id, with the tensor kept alive so the id stays its own (tensors
        # compare by value, so they cannot be dict keys); they are fake tensors and
        # live only while the step is traced.
        self._logits: dict[int, tuple[torch.Tensor, _Logits]] = {}
        self._transposed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            fused = self._cross_entropy(args, kwargs)
            if fused is not None:
                return fused
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: Any, kwargs: dict[str, Any], out: torch.Tensor) -> None:
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor):
            return
        if func is F.linear:
            weight, bias = _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            if bias is None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                watched = _watch(first, weight, out)
                self._logits[id(out)] = (out, _Logits(first, None, weight, out.dtype, watched))
        elif func in _TRANSPOSES and first.dim() == 2:
            self._transposed[id(out)] = (out, first)
        elif func in _MATMULS and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dim() == 2:
            right = args[1]
            weight = self._transposed[id(right)][1] if id(right) in self._transposed else None
            watched = _watch(first, right, *([] if weight is None else [weight]), out)
            self._logits[id(out)] = (out, _Logits(first, right, weight, out.dtype, watched))
        elif func in _RESHAPES and id(first) in self._logits and _same_rows(first, out) and _kept_or_upcast(first, out):
            self._logits[id(out)] = (out, self._logits[id(first)][1].through(out))

    def _cross_entropy(self, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        try:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        a = bound.arguments
        logits, target = a["input"], a["target"]
        found = self._logits.get(id(logits))
        origin = found[1] if found is not None else None
        if origin is None or not origin.unchanged() or not _supported(a, logits, target, origin):
            return None
        x = origin.x.reshape(-1, origin.x.shape[-1])
        loss = linear_cross_entropy(
            x.to(origin.dtype),
            origin.weight_rows().to(origin.dtype),
            target,
            ignore_index=a["ignore_index"],
            label_smoothing=a["label_smoothing"],
            reduction=a["reduction"],
        )
        return loss.to(_loss_dtype(logits))  # computed in fp32; returned as F.cross_entropy returns it


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype ``F.cross_entropy(logits, ...)`` returns: the logits', except that autocast
    runs it in fp32 (it is on autocast's fp32 list) from bf16 or fp16 logits."""
    autocast = torch.is_autocast_enabled(logits.device.type)
    return torch.float32 if autocast and logits.dtype in (torch.bfloat16, torch.float16) else logits.dtype


def _watch(*tensors: torch.Tensor | None) -> tuple[tuple[torch.Tensor, int], ...]:
    """The tensors (``None`` left out) with their version counters now."""
    return tuple((t, t._version) for t in tensors if t is not None)


def _arg(args: Any, kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _same_rows(before: torch.Tensor, after: torch.Tensor) -> bool:
    """A reshape or cast that keeps the classes as the last dimension."""
    return after.numel() == before.numel() and after.dim() >= 1 and after.shape[-1] == before.shape[-1]


def _kept_or_upcast(before: torch.Tensor, after: torch.Tensor) -> bool:
    """A cast the fused loss may look through: none, or to fp32 from a floating type (a
    round trip through bf16 rounds the logits, a cast to an integer type cuts their
    gradient: the kernel, computing from ``x`` and ``W``, would do neither)."""
    return after.dtype == before.dtype or (after.dtype == torch.float32 and before.dtype.is_floating_point)


def _supported(a: dict[str, Any], logits: torch.Tensor, target: Any, origin: _Logits) -> bool:
    classes = logits.shape[-1] if logits.dim() else 0
    return (
        logits.dim() == 2
        and classes >= MIN_CLASSES
        and origin.features_classes() == (origin.x.shape[-1], classes)
        and origin.x.numel() // max(origin.x.shape[-1], 1) == logits.shape[0]
        and logits.dtype in (torch.float32, origin.dtype)
        and isinstance(target, torch.Tensor)
        and target.dim() == 1
        and target.shape[0] == logits.shape[0]  # F.cross_entropy refuses others, by name
        and target.dtype == torch.int64  # what F.cross_entropy takes (it refuses int32)
        and a["weight"] is None
        and a["size_average"] is None
        and a["reduce"] is None
        and a["reduction"] in ("mean", "sum")
        and not is_dtensor(target)  # sharded steps keep the ATen ops, which DTensor shards
        and not any(is_dtensor(t) for t, _ in origin.watched)
        and type(a["ignore_index"]) is int  # not a bool, which F.cross_entropy refuses
        and isinstance(a["label_smoothing"], (int, float))
        and 0.0 <= a["label_smoothing"] <= 1.0  # F.cross_entropy refuses more, and ignores less
    )


_LOW = (torch.bfloat16, torch.float16)
GELU_MLP_DEVICES = ("cuda",)
"""Where :class:`GeluMlpMode` matches: where cuBLASLt runs it (elsewhere the own ops are
ATen's, and generated code fuses the GELU better)."""
_LINEAR_SIGNATURE = ("input", "weight", "bias")


@dataclass(frozen=True)
class _Hidden(_Watching):
    """``h = F.linear(x, weight, bias)`` (and then ``g = gelu_tanh(h)``): what the second
    linear of an MLP needs to run both on :func:`gelu_mlp`."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    autocast: bool
    watched: tuple[tuple[torch.Tensor, int], ...]  # ``x``, the weights, ``h`` (and ``g``)


class GeluMlpMode(TorchFunctionMode):
    """Active while a step is traced under ``sg.fuse``: ``F.linear(F.gelu(F.linear(x, W1,
    b1), approximate="tanh"), W2, b2)`` (an ``nn.Linear``, ``nn.GELU("tanh")``,
    ``nn.Linear`` MLP) runs on :func:`gelu_mlp`, the GELU and its gradient in the
    matmuls' epilogues.

    The first linear and the GELU run as written and are remembered; when the second
    linear's input is such a GELU, the whole MLP is computed again on the own kernel and
    the first two ops, now unused, go with the rest of the dead code (a step that also
    uses ``h`` or ``g`` keeps them for that use). Matched only where cuBLASLt runs it:
    CUDA tensors (:data:`GELU_MLP_DEVICES`) in bf16 or fp16, as autocast or the params make them,
    2-D weights, no DTensors; the exact GELU (``approximate="none"``) is not matched,
    nor an MLP whose input, weights, ``h`` or ``g`` were written in place in between.
    """

    def __init__(self) -> None:
        super().__init__()
        self.devices = GELU_MLP_DEVICES
        self._linear: dict[int, tuple[torch.Tensor, _Hidden]] = {}
        self._gelu: dict[int, tuple[torch.Tensor, _Hidden]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = (_arg(args, kwargs, i, name) for i, name in enumerate(_LINEAR_SIGNATURE))
            found = self._gelu.get(id(x)) if isinstance(x, torch.Tensor) else None
            if found is not None and found[1].unchanged() and self._second(found[1], x, weight, bias):
                first = found[1]
                lead = first.x.shape[:-1]
                y = gelu_mlp(
                    first.x.reshape(-1, first.x.shape[-1]).to(first.dtype),
                    first.weight.to(first.dtype),
                    None if first.bias is None else first.bias.to(first.dtype),
                    weight.to(first.dtype),
                    None if bias is None else bias.to(first.dtype),
                )
                return y.reshape(*lead, weight.shape[0])
            out = func(*args, **kwargs)
            if self._first(x, weight, bias, out):
                autocast = torch.is_autocast_enabled(out.device.type)
                watched = _watch(x, weight, bias, out)
                self._linear[id(out)] = (out, _Hidden(x, weight, bias, out.dtype, autocast, watched))
            return out
        out = func(*args, **kwargs)
        if func is F.gelu and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self._linear:
            approximate = _arg(args, kwargs, 1, "approximate")
            hidden = self._linear[id(args[0])][1]
            if approximate == "tanh" and isinstance(out, torch.Tensor) and hidden.unchanged():
                self._gelu[id(out)] = (out, hidden.through(out))
        return out

    def _first(self, x: Any, weight: Any, bias: Any, out: Any) -> bool:
        tensors = [t for t in (x, weight, bias, out) if t is not None]
        return (
            all(isinstance(t, torch.Tensor) and not is_dtensor(t) for t in tensors)
            and out.dtype in _LOW
            and out.device.type in self.devices
            and x.dim() >= 2
            and weight.dim() == 2
            and (bias is None or bias.dim() == 1)
            and out.shape[-1] % 8 == 0  # cuBLASLt's GELU input: a multiple of 8 columns
        )

    def _second(self, first: _Hidden, g: torch.Tensor, weight: Any, bias: Any) -> bool:
        """Whether ``F.linear(g, weight, bias)`` computes in ``first``'s dtype, as the
        own kernel would: under the same autocast, or with all of one dtype."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or is_dtensor(weight):
            return False
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1 or is_dtensor(bias)):
            return False
        if weight.shape[1] != g.shape[-1] or weight.device != g.device:
            return False
        device = g.device.type
        if torch.is_autocast_enabled(device) != first.autocast:
            return False
        if first.autocast:
            return torch.get_autocast_dtype(device) == first.dtype
        return weight.dtype == g.dtype == first.dtype and (bias is None or bias.dtype == first.dtype)
