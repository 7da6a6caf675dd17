"""The public transforms: validate options once, record them, wrap the step.

Each transform returns a :class:`Transformed`; stacking transforms adds records to
the same :class:`Options`, and the pass pipeline reads them in one canonical order,
so the order of the decorators does not change the meaning.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, overload

from . import tree
from .errors import ArgumentError, ArgumentTypeError, CaptureError, FallbackWarning, RetraceError, RetraceWarning
from .options import Fallback, Options, OutputMode, Retrace, StaticOptions, check_donate, check_literal
from .signature import Signature, signature_of
from .stages import Compiled, Counters, Lowered, Traced
from .trace import arg_layout, trace

__all__ = ["static", "Transformed"]


class Transformed:
    """A step wrapped by sgraph transforms: call it, or stage it with ``.trace``.

    Attributes:
        fn: the user's step.
        options: the validated options of every transform applied.
        trace_count: how many times the step was traced.
    """

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        self.fn = fn
        self.options = options
        self._cache: dict[Signature, Compiled] = {}
        self._last: Signature | None = None
        self._counters = Counters()
        self._fallback_reason: str | None = None
        functools.update_wrapper(self, fn)

    @property
    def api(self) -> str:
        """How messages name this step, e.g. ``sg.static(train_step)``."""
        return f"sg.static({_name(self.fn)})"

    @property
    def trace_count(self) -> int:
        """How many times the step has been traced (one per new signature, plus explicit ``.trace``)."""
        return self._counters.traces

    @property
    def last_compiled(self) -> Compiled | None:
        """The compiled step that ran on the latest call (its ``.stats``, listing...)."""
        return self._cache.get(self._last) if self._last is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fallback_reason is not None:
            return self.fn(*args, **kwargs)
        leaves, spec = tree.flatten((args, kwargs))
        signature = signature_of(leaves, spec)
        compiled = self._cache.get(signature)
        if compiled is not None:
            self._last = signature
            return compiled.call_flat(leaves)
        return self._first_call(signature, leaves, args, kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Trace the step for these arguments into one graph (no cache, no retrace policy).

        Example:
            >>> print(train_step.trace(params, opt_state, batch).as_text())
        """
        leaves, spec = tree.flatten((args, kwargs))
        layout = arg_layout(self.fn, args, kwargs, self._static.donate)
        signature = signature_of(leaves, spec, layout.paths)
        start = time.perf_counter()
        program = trace(self.fn, args, kwargs, api=self.api, layout=layout)
        self._counters.traces += 1
        return Traced(program, signature, layout, self.options, self._counters, time.perf_counter() - start)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Shorthand for ``self.trace(*args, **kwargs).lower()``."""
        return self.trace(*args, **kwargs).lower()

    @property
    def _static(self) -> StaticOptions:
        return self.options.effective_static

    def _first_call(self, signature: Signature, leaves: list[Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Trace, lower and compile for a new signature, then run (a CUDA graph captures on its first run)."""
        if self._last is not None:
            self._check_retrace(signature, args, kwargs)
        try:
            compiled = self.trace(*args, **kwargs).lower().compile()
            result = compiled.call_flat(leaves)
        except CaptureError as e:
            if self._static.fallback != "eager":
                raise
            self._fall_back(e)
            return self.fn(*args, **kwargs)
        self._cache[signature] = compiled
        self._last = signature
        return result

    def _check_retrace(self, signature: Signature, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        assert self._last is not None
        layout = arg_layout(self.fn, args, kwargs, ())
        change = signature.difference(self._last, layout.paths)
        policy = self._static.retrace
        message = (
            f"{self.api} is traced again (trace {self._counters.traces + 1}) because {change}. "
            "Each new signature compiles a new program; keep shapes and static arguments fixed "
            "(pad the last batch, pass changing numbers as tensors)"
        )
        if policy == "error":
            raise RetraceError(message + ", or pass retrace='warn' to allow it.")
        if policy == "warn":
            warnings.warn(message + ", or pass retrace='allow' to silence this.", RetraceWarning, stacklevel=4)
        self._counters.retraces += 1

    def _fall_back(self, error: CaptureError) -> None:
        self._fallback_reason = str(error)
        warnings.warn(
            f"{self.api}: the step cannot be captured, so it runs eagerly from now on "
            f"(fallback='eager'). Reason: {error}",
            FallbackWarning,
            stacklevel=4,
        )

    def __repr__(self) -> str:
        n = len(self._cache)
        return f"<{self.api}: {n} compiled signature{'s' * (n != 1)}, {self.trace_count} traces>"


@overload
def static(fn: Callable[..., Any], /) -> Transformed: ...
@overload
def static(
    *,
    donate: str | int | Sequence[str | int] = (),
    retrace: Retrace = "warn",
    fallback: Fallback = "none",
    outputs: OutputMode = "copy",
) -> Callable[[Callable[..., Any]], Transformed]: ...


def static(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    donate: str | int | Sequence[str | int] = (),
    retrace: Retrace = "warn",
    fallback: Fallback = "none",
    outputs: OutputMode = "copy",
) -> Transformed | Callable[[Callable[..., Any]], Transformed]:
    """Capture the whole step once and replay it: one CUDA graph on a GPU, the same
    compiled program without a graph on CPU.

    Args:
        fn: the pure step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.
        donate: argument names or positions whose tensors the step may overwrite:
            each donated leaf receives the output of the same shape and dtype (in
            order), and the result holds the very same tensor objects.
        retrace: what a call with a new signature (shape, dtype, device, static
            value) does: ``"warn"`` (trace again, warn naming the leaf),
            ``"error"`` (raise :class:`RetraceError`), ``"allow"`` (trace silently).
        fallback: ``"none"`` raises :class:`CaptureError` for a step that cannot be
            captured; ``"eager"`` warns once and runs it uncaptured instead.
        outputs: ``"copy"`` returns outputs no later call can overwrite; ``"view"``
            returns the CUDA graph's own output buffers (faster, but the next call
            overwrites them: read or clone them first).

    Returns:
        A :class:`Transformed` step (``.trace``, ``.lower``, ``.trace_count``...).

    Example:
        >>> @sg.static(donate=("params", "opt_state"))
        ... def train_step(params, opt_state, batch): ...
    """

    def wrap(f: Callable[..., Any]) -> Transformed:
        api = f"sg.static({_name(f)})"
        check_literal(api, "retrace", retrace, Retrace)
        check_literal(api, "fallback", fallback, Fallback)
        check_literal(api, "outputs", outputs, OutputMode)
        base, options = _unwrap(f)
        record = StaticOptions(check_donate(api, base, donate), retrace, fallback, outputs)
        return Transformed(base, options.with_static(record))

    return wrap if fn is None else wrap(fn)


def _unwrap(f: Callable[..., Any]) -> tuple[Callable[..., Any], Options]:
    if isinstance(f, Transformed):
        if f.options.static is not None:
            raise ArgumentError(f"{f.api}: sg.static is applied twice; apply it once.")
        return f.fn, f.options
    if not callable(f):
        raise ArgumentTypeError(f"sg.static: expected a function to transform; found {type(f).__name__}.")
    return f, Options()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
