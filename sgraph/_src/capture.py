"""The capture contract, enforced while a step is traced.

Two modes sit on top of ``make_fx``'s own while the user's step runs:

- :class:`GuardMode` (a torch-function mode) sees Python-level tensor calls. It
  rejects those that need a value or an address on the host (``.item()``,
  ``bool(t)``, ``print(t)``, ``.data_ptr()``...), adds the user's line to errors
  torch raises (keeping the type eager PyTorch raises), and tags each autograd node
  with the user line that made it, so backward ops can name the forward line they
  differentiate.
- :class:`SourceMode` (a dispatch mode) sees every ATen op and stamps the FX nodes
  ``make_fx`` records for it with a :class:`Source`. It also turns fake-tensor
  failures on data-dependent shapes into :class:`CaptureError`.

While it is active, :class:`GuardMode` also enters :func:`trace_guards` (from
:mod:`.capture_guards`, re-exported here): host syncs and changes to the global RNG
raise, and torch's ERROR logs about ops failing under fake tensors are dropped, all
in the tracing thread only.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .capture_guards import no_host_sync, quiet_torch_logs, rng_state_unchanged, trace_guards
from .dtensors import is_dtensor
from .errors import CaptureError, SgraphError
from .running_stats import hidden_writes
from .source import GRAD_MODULE_KEY, MODULE_KEY, SOURCE_KEY, Source, is_library, module_path, user_source, where
from .text import describe_tensor

_VIEW_OPS = frozenset(
    (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)
)

__all__ = [
    "Source",
    "GuardMode",
    "SourceMode",
    "user_source",
    "no_host_sync",
    "rng_state_unchanged",
    "quiet_torch_logs",
    "trace_guards",
    "SOURCE_KEY",
    "draws_random_numbers",
]

_HOST_VALUE = {
    "item": "reads a tensor's value on the host",
    "tolist": "copies a tensor to a Python list on the host",
    "numpy": "copies a tensor to a NumPy array on the host",
    "__array__": "copies a tensor to a NumPy array on the host",
    "__bool__": "uses a tensor's value in Python control flow (bool(tensor))",
    "__int__": "converts a tensor to a Python int",
    "__float__": "converts a tensor to a Python float",
    "__complex__": "converts a tensor to a Python complex",
    "__index__": "uses a tensor as a Python index",
}
_HOST_VALUE_WHY = "which cannot be captured into a graph (tensors have no values while the step is traced)"
_HOST_VALUE_FIX = (
    "Keep values as tensors: choose with torch.where(cond, a, b) instead of `if`, "
    "and return what you want to read as an output (e.g. in metrics), then read it after the call."
)
_PRINT = {"__repr__", "__str__", "__format__"}
_PRINT_FIX = "Return the tensor as an output (e.g. in metrics) and print it after the call."
_ADDRESS = {
    "data_ptr": "reads a memory address",
    "untyped_storage": "reads a tensor's storage (its memory address and size)",
    "storage": "reads a tensor's storage (its memory address and size)",
}
_ADDRESS_WHY = (
    "which has no meaning while the step is traced (its tensors have no memory yet) "
    "nor in a replay (the compiled step places its buffers itself)"
)
_ADDRESS_FIX = "Remove it from the step; compare or inspect tensors by value, or read addresses after the call."
_DATA_DEPENDENT_FIX = (
    "Use a fixed-shape form: torch.where(mask, x, 0) instead of x[mask] or nonzero, "
    "x.index_select(0, i) with an index tensor i instead of x[i] with a 0-dim tensor, "
    "torch.where(torch.arange(len(x)) < n, x, 0) instead of x[:n], and keep counts as tensors."
)


class GuardMode(TorchFunctionMode):
    """Reject host-value and address tensor calls; add the user line to torch's errors;
    tag autograd nodes with the user line. While active, :func:`trace_guards` holds for
    this thread (host syncs and global RNG changes raise; fake-tensor ERROR logs drop).

    Args:
        api: the transform's name, for error messages.

    Example:
        >>> with GuardMode("sg.static(step)"), SourceMode("sg.static(step)"):
        ...     out = step(*fake_args)  # inside make_fx
    """

    def __init__(self, api: str) -> None:
        super().__init__()
        self.api = api

    def __enter__(self) -> GuardMode:
        entered = cast(GuardMode, super().__enter__())
        self._guards = contextlib.ExitStack()
        try:
            self._guards.enter_context(trace_guards(self.api))
        except BaseException:
            super().__exit__(None, None, None)
            raise
        return entered

    def __exit__(self, *exc: Any) -> None:
        try:
            self._guards.__exit__(*exc)
        finally:
            super().__exit__(*exc)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_tensor_method(func):
            self._check_tensor_method(getattr(func, "__name__", ""), args, kwargs)
        try:
            out = func(*args, **kwargs)
        except SgraphError:
            raise
        except _data_dependent_errors():
            raise CaptureError(_data_dependent_message(self.api, _torch_name(func), user_source())) from None
        except Exception as e:
            _raise_located(e, self.api, user_source())
        _tag_grad_fns(out)
        return out

    def _check_tensor_method(self, name: str, args: Any, kwargs: dict[str, Any]) -> None:
        if name in _HOST_VALUE:
            name = _host_call_name(name)
            self._fail(f"Tensor.{name}() {_HOST_VALUE[name]}", _HOST_VALUE_WHY, _HOST_VALUE_FIX)
        if name in _ADDRESS:
            self._fail(f"Tensor.{name}() {_ADDRESS[name]}", _ADDRESS_WHY, _ADDRESS_FIX)
        if name in _PRINT:
            self._fail(f"printing a tensor (Tensor.{name})", _HOST_VALUE_WHY, _PRINT_FIX)
        if name in ("cpu", "to") and _moves_to_host(name, args, kwargs):
            self._fail(
                f"Tensor.{name}() copies a device tensor to the host",
                _HOST_VALUE_WHY,
                "Keep the computation on the device and return the tensor as an output.",
            )

    def _fail(self, what: str, why: str, fix: str) -> NoReturn:
        raise CaptureError(f"{self.api}: {what}{where(user_source())}, {why}. {fix}")


def _is_tensor_method(func: Callable[..., Any]) -> bool:
    owner = getattr(func, "__objclass__", None) or getattr(func, "__qualname__", "").split(".")[0]
    return owner in (torch.Tensor, torch._C.TensorBase, "Tensor")


def _host_call_name(name: str) -> str:
    """The host-value method the user called, e.g. ``tolist`` when ``FakeTensor.tolist``
    (plain Python, invisible to torch-function modes) calls ``item`` for it."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and is_library(frame):
        if frame.f_code.co_name in _HOST_VALUE and isinstance(frame.f_locals.get("self"), torch.Tensor):
            name = frame.f_code.co_name
        frame = frame.f_back
    return name


_TORCH_NAMESPACES = {
    "torch._C._nn": "torch.nn.functional",
    "torch._C._linalg": "torch.linalg",
    "torch._C._fft": "torch.fft",
    "torch._C._special": "torch.special",
}


_TENSOR_SYNTAX = {"__getitem__": "indexing x[...]", "__setitem__": "index assignment x[...] = v"}


def _torch_name(func: Callable[..., Any]) -> str:
    """``Tensor.view``, ``torch.arange``, ``torch.nn.functional.linear``: how the user wrote it."""
    name = getattr(func, "__name__", repr(func))
    if _is_tensor_method(func):
        syntax = _TENSOR_SYNTAX.get(name)
        return f"{syntax} (Tensor.{name})" if syntax else f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{_TORCH_NAMESPACES.get(module, module)}.{name}"


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
    """Write on the autograd nodes of ``out`` the user's line and the submodule that
    made them, for the backward ops they will record."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    source = None
    for t in outs:
        fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if fn is not None and SOURCE_KEY not in fn.metadata:
            source = source or user_source()
            if source is not None:
                fn.metadata[SOURCE_KEY] = source
            fn.metadata[MODULE_KEY] = module_path() or ""  # "": made outside any submodule


class SourceMode(TorchDispatchMode):
    """Stamp every FX node ``make_fx`` records with the :class:`Source` that made it.

    Args:
        api: the transform's name, for error messages.
        context: when given, a callable returning the source to stamp (used when
            re-tracing an existing graph node by node); otherwise the user's frame,
            or for backward ops the forward line of the autograd node being run.
        carried: when given, a callable returning more meta to stamp (when re-tracing:
            the module path and tags of the node being re-traced).
    """

    def __init__(
        self,
        api: str,
        context: Callable[[], Source | None] | None = None,
        carried: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.api = api
        self.context = context
        self.carried = carried
        self.last_backward: Source | None = None
        self.last_grad_module: str | None = None
        # storages of the real (not fake) tensors the trace itself made: a closed-over
        # constant's clone (sg.functional's buffers) may be written, the user's own may not
        self.made: set[int] = set()
        # local storages of DTensor views DTensor computed on a gathered copy: the view's
        # storage (kept, so its key is not reused), the view op, the base's layout, the line
        self.regathered: dict[int, tuple[Any, Any, str, Source | None]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.context is None:
            self._check_closed_over(func, args, kwargs)
            self._check_recomputed_randomness(func, args, kwargs)
            self._check_overlapping_write(func, args, kwargs)
            self._check_constant_write(func, args, kwargs)
            self._check_empty_dtensor_view(func, args)
            if self.regathered:
                self._check_write_into_regathered_view(func, args, kwargs)
        graph = _tracing_graph()
        last = _last_node(graph) if graph is not None else None
        try:
            out = func(*args, **kwargs)
        except SgraphError:
            raise
        except _data_dependent_errors():
            raise CaptureError(self._data_dependent(func, args)) from None
        except Exception as e:
            _raise_located(e, self.api, self._source())
        if self.context is None and _has_symbolic_shape(out):
            raise CaptureError(self._data_dependent(func, args))
        if self.context is None:
            self._note_made(args, kwargs, out)
            if args and is_dtensor(args[0]) and _returns_a_view(func):
                self._note_regathered_view(func, args[0], out)
        if graph is not None:
            self._stamp(graph, last)
        return out

    def _stamp(self, graph: torch.fx.Graph, last: torch.fx.Node | None) -> None:
        node = last.next if last is not None else _first_node(graph)
        source = None
        autograd_node = torch._C._current_autograd_node()
        module = module_path() if autograd_node is None else None
        grad_module = self._grad_module(autograd_node) if autograd_node is not None else None
        carried = self.carried() if self.carried is not None else {}
        while node is not None and node.op != "root":
            if SOURCE_KEY not in node.meta:
                source = source or self._source()
                if source is not None:
                    node.meta[SOURCE_KEY] = source
                if module is not None:
                    node.meta[MODULE_KEY] = module
                if grad_module is not None:
                    node.meta[GRAD_MODULE_KEY] = grad_module
                node.meta.update(carried)
            node = node.next

    def _grad_module(self, autograd_node: Any) -> str | None:
        """The submodule whose forward made the autograd node being run (for an
        untagged node, such as an autocast cast inside an op, the last one seen;
        None for a node made outside any submodule)."""
        tagged = cast("dict[str, Any]", autograd_node.metadata).get(MODULE_KEY)
        if tagged is not None:
            self.last_grad_module = tagged or None
        return self.last_grad_module

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

    def _check_overlapping_write(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """An in-place write into an expanded view (elements sharing memory): eager writes
        each memory location once, but a functional graph cannot express that (torch's
        functionalization sums the view's elements back into its base)."""
        if not isinstance(func, torch._ops.OpOverload):
            return
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor) and is_expanded(value):
                raise CaptureError(expanded_write_message(self.api, func, self._source(), of_a_view=False))

    def _check_constant_write(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """A write into a real tensor the step closes over (``counter.add_(1)``,
        ``hist[i] = x``, a closed-over module's BatchNorm statistics).

        Raised before the op runs: tracing would otherwise apply the write to the user's
        tensor once per trace, and the compiled step could not express it (constants
        are read, never written)."""
        if not isinstance(func, torch._ops.OpOverload):
            return
        for value in written_tensors(func, args, kwargs):
            if not _is_real(value) or value.numel() == 0 or _storage(value) in self.made:
                continue
            raise CaptureError(constant_write_message(self.api, func, tuple(value.shape), self._source()))

    def _check_empty_dtensor_view(self, func: Any, args: Any) -> None:
        """A reshape of a DTensor with no elements into another shape: DTensor's sharding
        rule for views divides by the zero size or never returns (torch 2.11 to 2.13),
        eagerly as under the trace. Raised before it runs, naming the line."""
        if func not in _VIEW_OPS or len(args) < 2 or not is_dtensor(args[0]) or args[0].numel():
            return
        shape = tuple(args[0].shape)
        try:
            target = torch.empty(shape, device="meta").reshape(args[1]).shape
        except RuntimeError:
            return  # not a valid view: DTensor's own error says so
        if [n for n in shape if n != 1] == [n for n in target if n != 1]:
            return  # only dims of size 1 come or go: the rule pairs the rest one to one
        raise CaptureError(
            f"{self.api}: a DTensor with no elements, {describe_tensor(args[0].dtype, shape)}, is reshaped"
            f" ({func.__name__}){where(self._source())}: DTensor's sharding rule for views cannot take a"
            " size-0 tensor into another shape (it divides by zero or never returns, in eager PyTorch as"
            " here). Skip the reshape when the tensor is empty, or give that dim a size."
        )

    def _note_regathered_view(self, func: Any, base: Any, out: Any) -> None:
        """Remember views of a DTensor that DTensor computed on a redistributed copy of its
        local shard (indexing a split dim gathers it first): they share no memory with it."""
        own = _storage_key(_local(base))
        for view in _tensors(out):
            if is_dtensor(view) and (key := _storage_key(_local(view))) != own:
                storage = _local(view).untyped_storage()
                self.regathered[key] = (storage, func, _placements(base), self._source())

    def _check_write_into_regathered_view(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """An in-place write into such a view: eager PyTorch loses it too (the DTensor
        written is a gathered copy, not the tensor it was viewed from), so it is refused."""
        for value in written_tensors(func, args, kwargs):
            if not is_dtensor(value):
                continue
            made = self.regathered.get(_storage_key(_local(value)))
            if made is None:
                continue
            _, view_op, placements, view_source = made
            source = self._source()
            made_at = " on the same line" if view_source == source else where(view_source)
            raise CaptureError(
                f"{self.api}: {func.__name__} writes in place into a view of a DTensor{where(source)}, but"
                f" that view ({view_op.__name__}{made_at}) indexes or reshapes a dim split over the mesh"
                f" (the DTensor viewed is laid out as {placements}), so DTensor computed it on a"
                " gathered copy: the write would not reach the tensor it was viewed from (eager PyTorch"
                " loses it the same way). Compute the new tensor out of place (torch.where, index_put,"
                " torch.cat) and use it instead, or lay the tensor out so that dim is not split"
                " (sg.replicate(), or a spec splitting another dim)."
            )

    def _note_made(self, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Remember the storages of real tensors ``out`` holds that no argument shares."""
        outs = [t for t in _tensors(out) if _is_real(t) and t.numel()]
        if not outs:
            return
        given = {_storage(t) for t in _tensors((args, kwargs)) if _is_real(t) and t.numel()}
        self.made.update(s for s in map(_storage, outs) if s not in given)

    def _check_recomputed_randomness(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """A random op run by autograd is a forward op recomputed (``torch.utils.checkpoint``).

        Eager replays it with the RNG state saved at the forward, so both draw the same
        numbers; a traced step records two independent draws, and the gradient would
        no longer be the gradient of the forward it differentiates.
        """
        if torch._C._current_autograd_node() is None or not draws_random_numbers(func, args, kwargs):
            return
        source = self._source()
        raise CaptureError(
            f"{self.api}: {func} runs again in the backward{where(source)}, as torch.utils.checkpoint "
            "recomputes it; in a captured step the recomputation would draw other random numbers than "
            "the forward did, so the gradients would be wrong. Draw the randomness from an sg.random key "
            "passed into the checkpointed function (sg.random.dropout(key, x, p)), or do not checkpoint "
            "the random op."
        )

    def _check_closed_over(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """A real tensor that requires grad is a parameter read from outside the step's
        arguments: it would be frozen into the graph as a constant, and never trained."""
        from torch._subclasses.fake_tensor import FakeTensor

        for a in _tensors((args, kwargs)):
            if type(a).__name__ == "DTensor":
                continue  # a wrapper: its local shard is checked when DTensor runs the op on it
            if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) and a.requires_grad:
                kind = "an nn.Parameter" if isinstance(a, torch.nn.Parameter) else "a tensor that requires grad"
                if torch._C._current_autograd_node() is not None:  # a recomputation in the backward
                    raise CaptureError(
                        f"{self.api}: {func} reads {kind} of shape {list(a.shape)}{where(user_source())} "
                        "in the backward: torch.utils.checkpoint recomputes a function that reads a "
                        "module's own parameters, not the ones passed to sg.functional's apply (the "
                        "recomputation runs after apply has put the module's own tensors back). Let "
                        "sg.plan_memory recompute it instead (sg.plan_memory(recompute='<module path>')), "
                        "or checkpoint a function that takes the weights as arguments."
                    )
                raise CaptureError(
                    f"{self.api}: {func} reads {kind} of shape {list(a.shape)}{where(user_source())} "
                    "that is not an argument of the step, so it would be frozen into the graph as a "
                    "constant and never updated. Pass it in as an argument: "
                    "apply, params, buffers = sg.functional(model), then apply(params, buffers, x)."
                )

    def _data_dependent(self, func: Any, args: Any) -> str:
        shapes = ", ".join(describe_tensor(a.dtype, tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
        op = f"{func} on ({shapes})" if shapes else str(func)
        return _data_dependent_message(self.api, op, self._source())


def _data_dependent_message(api: str, op: str, source: Source | None) -> str:
    return (
        f"{api}: {op}{where(source)} has an output shape (or a value) that depends on tensor data, "
        f"which cannot be captured into a graph (tensors have no values while the step is traced). "
        f"{_DATA_DEPENDENT_FIX}"
    )


def draws_random_numbers(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a forward op draws from the generator on this call.

    Backward ops tagged random (attention backward with dropout) replay the seed their
    forward saved; attention and dropout with probability 0 (or not training) draw nothing.
    """
    if not isinstance(func, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    if func._schema.name.endswith("_backward"):
        return False
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        if arg.name in ("dropout_p", "p") and value == 0:
            return False
        if arg.name in ("train", "training") and value is False:
            return False
    return True


def _has_symbolic_shape(out: Any) -> bool:
    """Whether an op's result has a size known only from tensor data (an unbacked SymInt)."""
    return any(isinstance(size, torch.SymInt) for t in _tensors(out) for size in t.shape)


def constant_write_message(api: str, op: object, shape: tuple[int, ...], source: Source | None) -> str:
    """The error for a step that writes into a tensor it closes over."""
    return (
        f"{api}: {op} writes in place into a tensor of shape {list(shape)} that the step closes "
        f"over{where(source)}: it is not an argument, so the compiled step could not update it. Pass it "
        "in as an argument and donate it (sg.static(step, donate=(...)) names it), or return its new value; for a "
        "module's buffers (BatchNorm's running statistics) use apply, params, buffers = "
        "sg.functional(model) and return the new buffers."
    )


def written_tensors(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes into: ``Tensor(a!)`` arguments, and the running
    statistics a training-mode batch norm writes without saying so."""
    found: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        found += _tensors(args[i] if i < len(args) else kwargs.get(arg.name))
    return found + hidden_writes(func, args, kwargs)


def _is_real(t: torch.Tensor) -> bool:
    """A plain tensor holding memory: not a fake tensor of the trace, not a wrapper."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, FakeTensor)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` views, for fake and traced tensors too (no data pointer needed)."""
    return t.untyped_storage()._cdata


@functools.cache
def _returns_a_view(func: Any) -> bool:
    """Whether ATen op ``func`` returns a view of its first argument (``Tensor(a)`` out)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    first = schema.arguments[0].alias_info
    out = schema.returns[0].alias_info
    return first is not None and out is not None and not out.is_write and first.before_set == out.before_set


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard."""
    return t._local_tensor


def _placements(t: Any) -> str:
    return ", ".join(str(p) for p in t.placements)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or results: nested lists, tuples and dicts (what
    an op's schema holds; cheaper than a pytree flatten, which the trace pays per op)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


@functools.cache
def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    """The errors torch raises for a data-dependent shape or value; looked up on the
    first error, not at import (``symbolic_shapes`` imports sympy, ~0.5 s)."""
    from torch._subclasses import fake_tensor

    names = ("DynamicOutputShapeException", "DataDependentOutputException")
    found = tuple(getattr(fake_tensor, n) for n in names if hasattr(fake_tensor, n))
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        found += (GuardOnDataDependentSymNode,)
    except ImportError:
        pass
    return found


def _tracing_graph() -> torch.fx.Graph | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return mode.tracer.graph if mode is not None else None


def _last_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    return next(iter(reversed(graph.nodes)), None)


def _first_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    return next(iter(graph.nodes), None)


# Errors torch raises on fake tensors with another type than the same mistake raises
# eagerly: (fake type, message start, eager type, eager hint). The fake kernels are
# Python references; eager runs the C++ kernels. Checked against eager in the tests.
_EAGER_TYPES: tuple[tuple[type[Exception], str, type[Exception], str], ...] = (
    (ValueError, "Cannot view a tensor with shape", RuntimeError, "; use .reshape(...) instead"),
    (ValueError, "div expected rounding_mode", RuntimeError, ""),
    (ValueError, "clamp called but both min and max are none", RuntimeError, ""),
    (ValueError, "alpha argument of type", RuntimeError, ""),
    (RuntimeError, "tensors used as indices must be long", IndexError, ""),
)
_LOCATED_ATTR = "__sgraph_located__"


def _raise_located(error: Exception, api: str, source: Source | None) -> NoReturn:
    """Re-raise ``error`` with the user's line added, as the type eager PyTorch raises.

    Args:
        error: what torch raised while tracing the user's call.
        api: the transform's name, e.g. ``sg.static(step)``.
        source: the user's line that made the failing call.

    Example:
        ``shape '[-1, 5]' is invalid for input of size 4 (raised at step.py:3 in step
        (`x.view(-1, 5)`) while sg.static(step) traced the step)``, still a RuntimeError.
    """
    if source is None or getattr(error, _LOCATED_ATTR, False) or not has_plain_message(error):
        raise error
    eager_type, hint = _eager_type(error)
    message = re.sub(r"\bFakeTensor\b", "Tensor", str(error).rstrip()) + hint
    sep = "\n" if "\n" in message else " "
    message += f"{sep}(raised at {source.describe()} while {api} traced the step)"
    located = error if eager_type is type(error) else eager_type(message)
    located.args = (message,)
    setattr(located, _LOCATED_ATTR, True)
    if located is error:
        raise error
    raise located.with_traceback(error.__traceback__) from None


def expanded_write_message(api: str, op: Any, source: Source | None, *, of_a_view: bool) -> str:
    """The error for an in-place write into an expanded view (``of_a_view``: into a view
    taken of one, ``w.expand(2, *w.shape)[0] = x``)."""
    into = "a view of an expanded view" if of_a_view else "an expanded view"
    example = "w[...] = x rather than w.expand(2, *w.shape)[0] = x"
    if not of_a_view:
        example = "w.zero_() rather than w.expand(...).zero_()"
    return (
        f"{api}: {op} writes in place into {into} (elements that share memory){where(source)}, which a "
        f"compiled step cannot reproduce exactly. Write into the tensor it expands instead ({example}), "
        "or compute a new tensor."
    )


def is_expanded(t: torch.Tensor) -> bool:
    """Whether ``t`` repeats elements in memory along some dim (stride 0, size > 1)."""
    return any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride()))


def has_plain_message(error: Exception) -> bool:
    """Whether the message is ``args[0]`` alone, so it can be extended without changing the type."""
    args = error.args
    plain = len(args) == 1 and isinstance(args[0], str) and str(error) == args[0]
    return plain and isinstance(error, (RuntimeError, ValueError, IndexError, TypeError))


def _eager_type(error: Exception) -> tuple[type[Exception], str]:
    for fake_type, start, eager_type, hint in _EAGER_TYPES:
        if type(error) is fake_type and str(error).startswith(start):
            return eager_type, hint
    return type(error), ""
