"""Guards around a whole trace that are seen by the tracing thread alone.

A trace must neither wait for the device (``torch.cuda.synchronize``) nor change the
global RNG (``torch.manual_seed``...): both would run once, at trace time, and never
in the compiled step. The functions are wrapped once, process-wide; each wrapper
consults a thread-local flag and otherwise does exactly what the original does, so
other threads see no change while a step traces, and nothing needs restoring after.
The same flag drops torch's ERROR logs about ops failing under fake tensors, which
only repeat the error sgraph raises.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, ModuleType
from typing import Any

import torch

from .errors import CaptureError
from .source import is_library, user_source, where

__all__ = ["no_host_sync", "rng_state_unchanged", "quiet_torch_logs", "trace_guards"]


class _ThreadScopes:
    """Which step each thread is tracing, for one concern; other threads never see it.

    Example:
        >>> with _SYNC.scope("sg.static(step)"):
        ...     _SYNC.current()
        'sg.static(step)'
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> str | None:
        """The API of the innermost step this thread is tracing, or None."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    def push(self, api: str) -> None:
        self._local.__dict__.setdefault("stack", []).append(api)

    def pop(self) -> None:
        self._local.stack.pop()

    @contextlib.contextmanager
    def scope(self, api: str) -> Iterator[None]:
        """Mark this thread as tracing ``api`` for the duration."""
        self.push(api)
        try:
            yield
        finally:
            self.pop()


_SYNC = _ThreadScopes()
_RNG = _ThreadScopes()
_QUIET = _ThreadScopes()
_GUARD_ATTR = "__sgraph_guard__"
_GUARD_LOCK = threading.Lock()


def _install_guard(module: ModuleType, name: str, check: Callable[[str, FrameType], None]) -> None:
    """Wrap ``module.name`` (once) so that it calls ``check(what, caller)`` first.

    The wrapper keeps the original's name, doc, signature and ``__wrapped__``, and
    does exactly what it does unless ``check`` raises. Whatever a test or profiler
    put there is what gets wrapped.
    """
    with _GUARD_LOCK:
        original = getattr(module, name, None)
        if original is None or getattr(original, _GUARD_ATTR, False):
            return
        what = f"{module.__name__}.{name}()"

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            check(what, sys._getframe(1))
            return original(*args, **kwargs)

        setattr(guarded, _GUARD_ATTR, True)
        setattr(module, name, guarded)


_QUIET_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.proxy_tensor")


class _DropWhileTracing(logging.Filter):
    """Drop ERROR records logged by a thread that is tracing a step.

    Torch logs "failed while attempting to run meta for ..." with a traceback when an
    op fails under fake tensors, then raises; sgraph raises that error with the user's
    line, so the log only repeats it. Other threads and other levels are untouched.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or _QUIET.current() is None


def _install_log_filter() -> None:
    with _GUARD_LOCK:
        for name in _QUIET_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _DropWhileTracing) for f in logger.filters):
                logger.addFilter(_DropWhileTracing())


@contextlib.contextmanager
def quiet_torch_logs(api: str) -> Iterator[None]:
    """Drop torch's ERROR logs about ops failing under fake tensors, in this thread only.

    :class:`GuardMode` does this while the step runs; use this around other tracing.

    Args:
        api: the transform's name (marks what this thread is tracing).

    Example:
        >>> with quiet_torch_logs("sg.static(step)"):
        ...     gm = make_fx(step, tracing_mode="fake")(x)
    """
    _install_log_filter()
    with _QUIET.scope(api):
        yield


@contextlib.contextmanager
def trace_guards(api: str) -> Iterator[None]:
    """Everything this module guards, for this thread, while it traces ``api``.

    :class:`~sgraph._src.capture.GuardMode` enters it around the user's step.

    Args:
        api: the transform's name, e.g. ``sg.static(train_step)``.

    Example:
        >>> with trace_guards("sg.static(step)"):
        ...     gm = make_fx(step, tracing_mode="fake")(x)
    """
    with quiet_torch_logs(api), no_host_sync(api), rng_state_unchanged(api):
        yield


def _refuse_sync(what: str, caller: FrameType) -> None:
    api = _SYNC.current()
    if api is not None:
        raise CaptureError(
            f"{api}: {what}{where(user_source())} waits for the device from the host, which "
            "cannot be captured into a graph. Remove it from the step; synchronize after the call "
            "if you must."
        )


def _sync_modules() -> list[ModuleType]:
    accelerator = getattr(torch, "accelerator", None)
    return [torch.cuda] + ([accelerator] if isinstance(accelerator, ModuleType) else [])


@contextlib.contextmanager
def no_host_sync(api: str) -> Iterator[None]:
    """Make ``torch.cuda.synchronize()`` (and ``torch.accelerator.synchronize()``) raise
    :class:`CaptureError` when called by this thread while it traces ``api``.

    The functions are wrapped once, process-wide, by wrappers that behave exactly like
    the originals in every thread that is not tracing: other threads may synchronize
    while a step traces, and nothing is restored (or restored wrongly) afterwards.

    Args:
        api: the transform's name, e.g. ``sg.static(train_step)``.

    Example:
        >>> with no_host_sync("sg.static(step)"):
        ...     torch.cuda.synchronize()  # raises CaptureError in this thread only
    """
    _install_sync_guards()
    with _SYNC.scope(api):
        yield


def _install_sync_guards() -> None:
    for module in _sync_modules():
        _install_guard(module, "synchronize", _refuse_sync)


_RNG_FUNCTIONS = {
    "torch": ("manual_seed", "seed", "set_rng_state"),
    "torch.random": ("manual_seed", "seed", "set_rng_state", "fork_rng"),
    "torch.cuda": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
}
_RNG_WHY = (
    "which would run only once, while the step is traced, and never when the compiled step runs "
    "(its random ops draw from the generator as it is at each call)"
)
_RNG_FIX = (
    "Seed outside the step (e.g. torch.manual_seed before the first call), or pass a key made by "
    "sg.random.key(seed) in as an argument and draw with sg.random.uniform / normal / dropout "
    "(split it with sg.random.split)."
)


def _refuse_rng(what: str, caller: FrameType) -> None:
    """Refuse a direct call from user code; torch's own uses (checkpoint) pass through."""
    api = _RNG.current()
    if api is None:
        _count_outside_write()
        return
    if is_library(caller):
        return
    raise CaptureError(f"{api}: {what} changes the global RNG state{where(user_source())}, {_RNG_WHY}. {_RNG_FIX}")


# Seeding calls made by threads that are not tracing: while one happens during a
# trace, a changed seed cannot be blamed on the step, so nothing is restored.
_outside_writes = 0


def _count_outside_write() -> None:
    global _outside_writes
    with _GUARD_LOCK:
        _outside_writes += 1


def _rng_generators() -> list[tuple[str, torch.Generator]]:
    """The global generators: the CPU one, and CUDA's only where CUDA is initialized."""
    generators = [("the CPU generator", torch.default_generator)]
    if torch.cuda.is_initialized():
        generators += [(f"CUDA generator {i}", g) for i, g in enumerate(torch.cuda.default_generators)]
    return generators


@contextlib.contextmanager
def rng_state_unchanged(api: str) -> Iterator[None]:
    """Raise :class:`CaptureError` when tracing ``api`` seeds or sets the global RNG.

    Direct calls of ``torch.manual_seed``, ``torch.random.seed``, ``torch.set_rng_state``,
    ``torch.random.fork_rng``, ``torch.cuda.manual_seed``... from the step raise at once,
    naming the line. Anything else that reseeds a global generator (e.g.
    ``torch.default_generator.manual_seed``) is found by comparing seeds after the
    trace: the saved state is restored, then the error is raised. Seeds, not states,
    are compared, so random draws in other threads meanwhile are no false alarm.
    Fake-tensor tracing of random ops (``torch.rand``, dropout) draws nothing.

    Args:
        api: the transform's name, e.g. ``sg.static(train_step)``.

    Example:
        >>> with rng_state_unchanged("sg.static(step)"):
        ...     gm = make_fx(step, tracing_mode="fake")(x)
    """
    _install_rng_guards()
    saved = _save_rng()
    try:
        with _RNG.scope(api):
            yield
    finally:
        reseeded = _restore_reseeded(saved)
    if reseeded:
        raise CaptureError(
            f"{api}: the step changes the global RNG state (it reseeds {' and '.join(reseeded)}, e.g. "
            f"with torch.default_generator.manual_seed), {_RNG_WHY}. {_RNG_FIX} The state was restored."
        )


def _install_rng_guards() -> None:
    for module_name, names in _RNG_FUNCTIONS.items():
        for name in names:
            _install_guard(sys.modules[module_name], name, _refuse_rng)


_SavedRng = tuple[int, list[tuple[str, torch.Generator, int, torch.Tensor]]]


def _save_rng() -> _SavedRng:
    return _outside_writes, [(label, g, g.initial_seed(), g.get_state()) for label, g in _rng_generators()]


def _restore_reseeded(saved: _SavedRng) -> list[str]:
    """Restore each generator whose seed the step changed; return their labels."""
    outside_writes, generators = saved
    if outside_writes != _outside_writes:
        return []
    reseeded = []
    for label, generator, seed, state in generators:
        if generator.initial_seed() != seed:
            generator.set_state(state)
            reseeded.append(label)
    return reseeded


# Installed when sgraph is imported, so that tracing never changes which function
# object torch.cuda.synchronize or torch.manual_seed is; each scope installs again
# over whatever a test or profiler put there since.
_install_sync_guards()
_install_rng_guards()
