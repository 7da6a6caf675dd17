"""The capture contract, enforced while a step is traced, and source lines for nodes.

Two modes sit on top of ``make_fx``'s own while the user's step runs:

- :class:`GuardMode` (a torch-function mode) sees Python-level tensor calls. It
  rejects those that need a value on the host (``.item()``, ``bool(t)``,
  ``print(t)``...) and tags each autograd node with the user line that made it,
  so backward ops can name the forward line they differentiate.
- :class:`SourceMode` (a dispatch mode) sees every ATen op and stamps the FX nodes
  ``make_fx`` records for it with a :class:`Source`. It also turns fake-tensor
  failures on data-dependent shapes into :class:`CaptureError`.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, cast

import optree
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import CaptureError
from .text import describe_tensor

__all__ = ["Source", "GuardMode", "SourceMode", "user_source", "no_host_sync", "SOURCE_KEY"]

SOURCE_KEY = "sgraph_source"
_SKIP_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch, optree, sys.modules[__package__]) if m.__file__
) + (os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py",)


@dataclass(frozen=True)
class Source:
    """Where in the user's code a graph node comes from."""

    file: str
    line: int
    function: str
    backward: bool = False

    @property
    def code(self) -> str:
        """The text of the source line, stripped."""
        return linecache.getline(self.file, self.line).strip()

    def short(self) -> str:
        """``file.py:12 in fn``, prefixed with ``backward of`` for gradient ops."""
        where = f"{os.path.basename(self.file)}:{self.line} in {self.function}"
        return f"backward of {where}" if self.backward else where

    def describe(self) -> str:
        """``file.py:12 in fn (`code`)``, for error messages."""
        code = self.code
        return f"{self.short()} (`{code}`)" if code else self.short()

    def as_backward(self) -> Source:
        return Source(self.file, self.line, self.function, backward=True)


def user_source() -> Source | None:
    """The innermost frame of the caller's stack that is not torch's, optree's or sgraph's."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP_DIRS) and not name.startswith("<frozen"):
            return Source(name, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def _where(source: Source | None) -> str:
    return f" at {source.describe()}" if source else ""


_HOST_VALUE = {
    "item": "reads a tensor's value on the host",
    "tolist": "copies a tensor to a Python list on the host",
    "numpy": "copies a tensor to a NumPy array on the host",
    "__bool__": "uses a tensor's value in Python control flow (bool(tensor))",
    "__int__": "converts a tensor to a Python int",
    "__float__": "converts a tensor to a Python float",
    "__complex__": "converts a tensor to a Python complex",
    "__index__": "uses a tensor as a Python index",
}
_HOST_VALUE_FIX = (
    "Keep values as tensors: choose with torch.where(cond, a, b) instead of `if`, "
    "and return what you want to read as an output (e.g. in metrics), then read it after the call."
)
_PRINT = {"__repr__", "__str__", "__format__"}
_PRINT_FIX = "Return the tensor as an output (e.g. in metrics) and print it after the call."


class GuardMode(TorchFunctionMode):
    """Reject host-value tensor calls; tag autograd nodes with the user line."""

    def __init__(self, api: str) -> None:
        super().__init__()
        self.api = api

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_VALUE and _is_tensor_method(func):
            self._fail(f"Tensor.{name}() {_HOST_VALUE[name]}", _HOST_VALUE_FIX)
        if name in _PRINT and _is_tensor_method(func):
            self._fail(f"printing a tensor (Tensor.{name})", _PRINT_FIX)
        if name in ("cpu", "to") and _is_tensor_method(func) and _moves_to_host(name, args, kwargs):
            self._fail(
                f"Tensor.{name}() copies a device tensor to the host",
                "Keep the computation on the device and return the tensor as an output.",
            )
        out = func(*args, **kwargs)
        _tag_grad_fns(out)
        return out

    def _fail(self, what: str, fix: str) -> None:
        source = user_source()
        raise CaptureError(
            f"{self.api}: {what}{_where(source)}, which cannot be captured into a graph "
            f"(tensors have no values while the step is traced). {fix}"
        )


def _is_tensor_method(func: Callable[..., Any]) -> bool:
    owner = getattr(func, "__objclass__", None) or getattr(func, "__qualname__", "").split(".")[0]
    return owner in (torch.Tensor, torch._C.TensorBase, "Tensor")


def _moves_to_host(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    self = args[0] if args else None
    if not isinstance(self, torch.Tensor) or self.device.type in ("cpu", "meta"):
        return False
    if name == "cpu":
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False


def _tag_grad_fns(out: Any) -> None:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    source = None
    for t in outs:
        fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if fn is not None and SOURCE_KEY not in fn.metadata:
            source = source or user_source()
            if source is not None:
                fn.metadata[SOURCE_KEY] = source


class SourceMode(TorchDispatchMode):
    """Stamp every FX node ``make_fx`` records with the :class:`Source` that made it.

    Args:
        api: the transform's name, for error messages.
        context: when given, a callable returning the source to stamp (used when
            re-tracing an existing graph node by node); otherwise the user's frame,
            or for backward ops the forward line of the autograd node being run.
    """

    def __init__(self, api: str, context: Callable[[], Source | None] | None = None) -> None:
        super().__init__()
        self.api = api
        self.context = context
        self.last_backward: Source | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.context is None:
            self._check_closed_over(func, args, kwargs)
        graph = _tracing_graph()
        last = _last_node(graph) if graph is not None else None
        try:
            out = func(*args, **kwargs)
        except _DATA_DEPENDENT as e:
            raise CaptureError(self._data_dependent(func, args)) from e
        if self.context is None and _has_symbolic_shape(out):
            raise CaptureError(self._data_dependent(func, args))
        if graph is not None:
            self._stamp(graph, last)
        return out

    def _stamp(self, graph: torch.fx.Graph, last: torch.fx.Node | None) -> None:
        node = last.next if last is not None else _first_node(graph)
        source = None
        while node is not None and node.op != "root":
            if SOURCE_KEY not in node.meta:
                source = source or self._source()
                if source is not None:
                    node.meta[SOURCE_KEY] = source
            node = node.next

    def _source(self) -> Source | None:
        if self.context is not None:
            return self.context()
        autograd_node = torch._C._current_autograd_node()
        if autograd_node is not None:
            # The stubs declare ``metadata`` a method; at runtime it is a dict property.
            tagged = cast("dict[str, Any]", autograd_node.metadata).get(SOURCE_KEY)
            if tagged is not None:
                self.last_backward = tagged.as_backward()
            return self.last_backward or user_source()
        return user_source()

    def _check_closed_over(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """A real tensor that requires grad is a parameter read from outside the step's
        arguments: it would be frozen into the graph as a constant, and never trained."""
        from torch._subclasses.fake_tensor import FakeTensor

        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) and a.requires_grad:
                kind = "an nn.Parameter" if isinstance(a, torch.nn.Parameter) else "a tensor that requires grad"
                raise CaptureError(
                    f"{self.api}: {func} reads {kind} of shape {list(a.shape)}{_where(user_source())} "
                    "that is not an argument of the step, so it would be frozen into the graph as a "
                    "constant and never updated. Pass it in as an argument: "
                    "apply, params, buffers = sg.functional(model), then apply(params, buffers, x)."
                )

    def _data_dependent(self, func: Any, args: Any) -> str:
        shapes = ", ".join(describe_tensor(a.dtype, tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
        return (
            f"{self.api}: {func} on ({shapes}){_where(user_source())} has an output shape (or a value) "
            "that depends on tensor data, which cannot be captured into a graph. Use a fixed-shape "
            "form: torch.where(mask, x, 0) instead of x[mask] or nonzero, and keep counts as tensors."
        )


def _has_symbolic_shape(out: Any) -> bool:
    """Whether an op's result has a size known only from tensor data (an unbacked SymInt)."""
    return any(
        isinstance(size, torch.SymInt)
        for t in torch.utils._pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor)
        for size in t.shape
    )


def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses import fake_tensor

    names = ("DynamicOutputShapeException", "DataDependentOutputException")
    found = tuple(getattr(fake_tensor, n) for n in names if hasattr(fake_tensor, n))
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        found += (GuardOnDataDependentSymNode,)
    except ImportError:
        pass
    return found


_DATA_DEPENDENT = _data_dependent_errors()


def _tracing_graph() -> torch.fx.Graph | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return mode.tracer.graph if mode is not None else None


def _last_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    return next(iter(reversed(graph.nodes)), None)


def _first_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    return next(iter(graph.nodes), None)


@contextlib.contextmanager
def no_host_sync(api: str) -> Iterator[None]:
    """Make ``torch.cuda.synchronize()`` raise :class:`CaptureError` while tracing."""
    original = torch.cuda.synchronize

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise CaptureError(
            f"{api}: torch.cuda.synchronize(){_where(user_source())} waits for the device from the "
            "host, which cannot be captured into a graph. Remove it from the step; synchronize "
            "after the call if you must."
        )

    torch.cuda.synchronize = refuse
    try:
        yield
    finally:
        torch.cuda.synchronize = original
