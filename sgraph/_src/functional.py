"""A module as a pure function of dict pytrees.

``sg.functional(module)`` splits an ``nn.Module`` into ``apply`` (a pure function) and
two dicts of tensors, ``params`` and ``buffers``, keyed by fully qualified name. The
module itself is never changed by ``apply``: the tensors passed in take the place of
its own for the duration of one call (``torch.func.functional_call``).

Three kinds of module need more than ``functional_call``:

* Modules that hold one submodule under several names (``nn.Sequential(lin, act,
  lin)``). ``functional_call`` leaves such a submodule holding the tensors passed in
  (torch 2.11 to 2.13), so ``apply`` puts the module's own tensors back itself.

* Modules that write buffers in forward (BatchNorm's running statistics). ``apply``
  runs them on clones and returns the new buffers next to the output, so the
  buffers passed in are never written.
* Modules wrapped by FSDP2 (``torch.distributed.fsdp.fully_shard``). FSDP2's forward
  hooks all-gather the module's *own* sharded parameters and swap them in, which
  would ignore the tensors passed to ``apply``. ``apply`` gathers the DTensors it is
  given itself (differentiably) and runs the forward with FSDP2's forward hooks
  taken out of the hook dicts for the duration of the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from .errors import ArgumentError, ArgumentTypeError, TreeStructureError, UnsupportedError
from .guards import is_tracing, note_module
from .source import module_scopes
from .tree import flatten_with_paths

__all__ = ["functional", "Apply", "ArgumentError", "ArgumentTypeError", "UnsupportedError"]

Tensor = torch.Tensor


# --------------------------------------------------------------------------- public API


def functional(
    module: nn.Module, /, *, return_buffers: bool | None = None
) -> tuple[Apply, dict[str, Tensor], dict[str, Tensor]]:
    """Split ``module`` into a pure function and dicts of its parameters and buffers.

    ``params`` and ``buffers`` hold ``t.detach()`` of the module's own tensors: they
    share storage with the module (nothing is copied), so a step that donates them,
    or any in-place update of them, also changes the module's weights. ``params`` holds
    the parameters that require grad; frozen ones (``requires_grad=False`` when
    ``functional`` is called) come first in ``buffers``, so a step differentiating and
    updating ``params`` leaves them as they are, as ``torch.optim`` does. Tied
    parameters (one ``Parameter`` under several names) are one leaf, under the first
    name ``named_parameters()`` gives. For a module wrapped by FSDP2 the values of
    ``params`` are the sharded DTensors themselves (detached).

    Args:
        module: any ``nn.Module``.
        return_buffers: whether ``apply`` returns ``(out, new_buffers)`` instead of
            ``out``. ``None`` (default) decides once, here: True iff the module
            contains a norm layer that tracks running statistics (BatchNorm,
            ``track_running_stats=True``), in train and eval mode alike, so the
            output type never depends on the mode.

    Returns:
        ``(apply, params, buffers)``. ``apply(params, buffers, *args, **kwargs)``
        runs ``module(*args, **kwargs)`` with the given tensors in place of the
        module's own, and returns ``out`` or ``(out, new_buffers)``. ``new_buffers``
        has every key of ``buffers``: the entries forward did not write are the very
        tensors passed in, the written ones are new tensors. ``apply`` never writes
        the module (parameters, buffers, training flag, hooks) nor the tensors
        passed in, and can be traced by ``make_fx`` and differentiated with
        ``torch.autograd.grad``.

    Raises:
        ArgumentTypeError: ``module`` is not an ``nn.Module``, or ``return_buffers``
            is not a bool or None.
        UnsupportedError: FSDP1, FSDP2 mixed precision, or a torch whose
            FSDP2 internals differ from what this module knows.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> apply, params, buffers = sg.functional(model)
        >>> out, buffers = apply(params, buffers, torch.randn(8, 4))
    """
    _check_arguments(module, return_buffers)
    named = list(module.named_parameters())
    params = {name: p.detach() for name, p in named if p.requires_grad}
    frozen = {name: p.detach() for name, p in named if not p.requires_grad}
    buffers = {**frozen, **{name: b.detach() for name, b in module.named_buffers()}}
    spec = _Spec(
        param_shapes={name: p.shape for name, p in params.items()},
        buffer_shapes={name: b.shape for name, b in buffers.items()},
        frozen=tuple(frozen),
        return_buffers=_tracks_running_stats(module) if return_buffers is None else return_buffers,
        norm_layers=_norm_layers(module),
        fsdp_states=_fsdp_states(module),
        shared=_has_shared_submodules(module),
    )
    return Apply(module, spec), params, buffers


class Apply:
    """The pure function returned by :func:`functional`; see there for its contract.

    Example:
        >>> apply, params, buffers = sg.functional(torch.nn.Linear(2, 3))
        >>> apply(params, buffers, torch.ones(1, 2)).shape
        torch.Size([1, 3])
    """

    __slots__ = ("_module", "_spec")

    def __init__(self, module: nn.Module, spec: _Spec) -> None:
        self._module = module
        self._spec = spec

    @property
    def module(self) -> nn.Module:
        """The module this function runs (never modified by a call)."""
        return self._module

    @property
    def return_buffers(self) -> bool:
        """Whether a call returns ``(out, new_buffers)`` rather than ``out``."""
        return self._spec.return_buffers

    def __repr__(self) -> str:
        return f"<sg.functional apply of {type(self._module).__name__}, return_buffers={self.return_buffers}>"

    def __call__(
        self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], /, *args: Any, **kwargs: Any
    ) -> Any:
        """Run the module on ``params`` and ``buffers``; see :func:`functional`."""
        spec = self._spec
        note_module(self._module)  # a traced step depends on the modules' training flags
        _check_tensors(params, spec.param_shapes, arg="params", what="parameter")
        _check_tensors(buffers, spec.buffer_shapes, arg="buffers", what="buffer")
        norm_buffers = _norm_buffers(spec.norm_layers, buffers)
        fsdp = bool(spec.fsdp_states)
        if fsdp:
            _check_local_inputs(self._module, args, kwargs)
        frozen = _gathered({k: buffers[k] for k in spec.frozen}, fsdp=fsdp)
        kept = {k: b for k, b in buffers.items() if k not in frozen}
        cloned = frozenset(kept) if spec.return_buffers else frozenset(k for ks in norm_buffers for k in ks)
        run_buffers = {k: b.clone() if k in cloned else b for k, b in kept.items()}
        versions = {k: _version(b) for k, b in run_buffers.items()}
        tensors = {**_gathered(params, fsdp=fsdp), **frozen, **run_buffers}
        scopes = module_scopes(self._module) if is_tracing() else contextlib.nullcontext()
        restored = _tensors_restored(self._module) if spec.shared else contextlib.nullcontext()
        with _fsdp_forward_hooks_removed(spec.fsdp_states), scopes, restored:
            # functional_call writes what the module holds after forward back into
            # ``tensors``: that is how a buffer reassigned in forward shows up.
            out = torch.func.functional_call(self._module, tensors, args, kwargs, tie_weights=True, strict=True)
        known = _norm_written(norm_buffers, run_buffers, versions)
        written = _written(run_buffers, tensors, versions, known=known, cloned=cloned)
        if spec.return_buffers:
            return out, {k: tensors[k] if k in written else b for k, b in buffers.items()}
        in_place = [k for k in written if k not in cloned and _version(buffers[k]) != versions[k]]
        _check_nothing_written(written, in_place=in_place)
        return out


# --------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What ``functional`` fixed about the module, read by every call of ``apply``."""

    param_shapes: dict[str, torch.Size]
    buffer_shapes: dict[str, torch.Size]  # frozen parameters' too
    frozen: tuple[str, ...]  # parameters that do not require grad, passed among the buffers, in the
    # module's order: under FSDP2 each rank gathers them in this order, so it must not vary with the hash seed
    return_buffers: bool
    norm_layers: tuple[tuple[str, _NormBase], ...]
    fsdp_states: tuple[Any, ...]
    shared: bool  # a submodule under several names: see _tensors_restored


def _has_shared_submodules(module: nn.Module) -> bool:
    return sum(1 for _ in module.named_modules(remove_duplicate=False)) != sum(1 for _ in module.modules())


@contextlib.contextmanager
def _tensors_restored(module: nn.Module) -> Iterator[None]:
    """Put every submodule's own parameters and buffers back after the block, whatever
    it left there (the same objects, in their order)."""
    saved: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (d, dict(d)) for m in module.modules() for d in (m._parameters, m._buffers)
    ]
    try:
        yield
    finally:
        for d, own in saved:
            d.clear()
            d.update(own)


def _check_arguments(module: Any, return_buffers: Any) -> None:
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(
            f"sg.functional: module must be a torch.nn.Module, found {type(module).__name__}. "
            "Pass the model object itself, e.g. sg.functional(model)."
        )
    if return_buffers is not None and not isinstance(return_buffers, bool):
        raise ArgumentTypeError(
            f"sg.functional: return_buffers must be True, False or None (automatic), found {return_buffers!r}."
        )


def _norm_layers(module: nn.Module) -> tuple[tuple[str, _NormBase], ...]:
    """Every norm layer that keeps running statistics, with its name."""
    return tuple((name, m) for name, m in module.named_modules() if isinstance(m, _NormBase) and m.track_running_stats)


def _tracks_running_stats(module: nn.Module) -> bool:
    return bool(_norm_layers(module))


def _norm_buffers(norm_layers: Iterable[tuple[str, _NormBase]], buffers: Mapping[str, Tensor]) -> list[list[str]]:
    """The buffer keys of each norm layer now in train mode: the buffers forward may write."""
    groups = []
    for prefix, layer in norm_layers:
        if layer.training:
            keys = (f"{prefix}.{name}" if prefix else name for name, _ in layer.named_buffers(recurse=False))
            groups.append([k for k in keys if k in buffers])
    return groups


def _norm_written(
    norm_buffers: list[list[str]], run_buffers: dict[str, Tensor], versions: dict[str, int | None]
) -> frozenset[str]:
    """The buffers of the norm layers that ran in train mode during this call.

    BatchNorm updates its running statistics inside ``native_batch_norm``, whose
    schema does not mark them mutated, so their version counters do not move; its
    ``num_batches_tracked.add_(1)`` does, so that counter tells whether the layer ran.
    Without a readable counter, the layer counts as having run.
    """
    written: set[str] = set()
    for keys in norm_buffers:
        counter = next((k for k in keys if k.rsplit(".", 1)[-1] == "num_batches_tracked"), None)
        before = versions[counter] if counter is not None else None
        if before is None or _version(run_buffers[cast(str, counter)]) != before:
            written.update(keys)
    return frozenset(written)


# --------------------------------------------------------------------------- validation


def _check_tensors(tree: Any, shapes: dict[str, torch.Size], *, arg: str, what: str) -> None:
    """Check ``tree`` is a dict with exactly the keys of ``shapes`` and tensors of those shapes."""
    if not isinstance(tree, Mapping):
        raise TreeStructureError(
            f"apply: {arg} must be a dict of tensors keyed by {what} name, found {type(tree).__name__}. "
            f"Pass the {arg} dict returned by sg.functional (or one with the same keys)."
        )
    _check_keys(tree, shapes, arg=arg, what=what)
    for key, shape in shapes.items():
        value = tree[key]
        if not isinstance(value, torch.Tensor):
            raise ArgumentTypeError(
                f"apply: {arg}[{key!r}] must be a torch.Tensor of shape {tuple(shape)}, found {type(value).__name__}."
            )
        if value.shape != shape:
            raise ArgumentError(
                f"apply: {arg}[{key!r}] has shape {tuple(value.shape)}, expected {tuple(shape)} "
                f"(the shape of the module's {what} {key!r}). Pass a tensor of the module's shape."
            )


def _check_keys(tree: Mapping[str, Any], shapes: dict[str, torch.Size], *, arg: str, what: str) -> None:
    missing = [k for k in shapes if k not in tree]
    unexpected = [k for k in tree if k not in shapes]
    if not missing and not unexpected:
        return
    found = []
    if missing:
        found.append(f"is missing {_quoted(missing)}")
    if unexpected:
        found.append(f"has unexpected key(s) {_quoted(unexpected)} (not a {what} of the module)")
    raise TreeStructureError(
        f"apply: {arg} {' and '.join(found)}; pass the dict returned by sg.functional (or one with the same keys)."
    )


def _quoted(keys: list[Any]) -> str:
    return ", ".join(repr(k) for k in keys)


# --------------------------------------------------------------------------- buffer writes


def _version(t: Tensor) -> int | None:
    """The tensor's in-place write counter; None where it has none (inference tensors)."""
    return None if t.is_inference() else t._version


def _written(
    run_buffers: dict[str, Tensor],
    after: dict[str, Tensor],
    versions: dict[str, int | None],
    *,
    known: frozenset[str],
    cloned: frozenset[str],
) -> list[str]:
    """The buffers forward wrote: in place (version moved), by assigning a new tensor, or ``known``.

    A clone whose counter cannot be read (an inference tensor) counts as written:
    returning it is right either way.
    """
    written = []
    for key, buf in run_buffers.items():
        reassigned = after[key] is not buf
        unknown = versions[key] is None and key in cloned
        if key in known or reassigned or unknown or _version(buf) != versions[key]:
            written.append(key)
    return written


def _check_nothing_written(written: list[str], *, in_place: list[str]) -> None:
    if not written:
        return
    note = f" (the tensors passed as buffers {_quoted(in_place)} have been written too)" if in_place else ""
    raise ArgumentError(
        f"apply: the module wrote buffer(s) {_quoted(written)} in forward{note}, but this apply was made "
        "with return_buffers=False, so the update would be lost. Use sg.functional(module, return_buffers=True) "
        "and take (out, new_buffers) from apply."
    )


# --------------------------------------------------------------------------- FSDP2


def _fsdp_states(module: nn.Module) -> tuple[Any, ...]:
    """The FSDP2 states of ``module`` and its submodules (each once), checked for what apply needs."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # never imported, so no module can be wrapped (and importing it costs seconds)
        return ()
    states: dict[int, Any] = {}
    for name, m in module.named_modules():
        if isinstance(m, fsdp.FullyShardedDataParallel):
            raise UnsupportedError(
                f"sg.functional: submodule {name or '<root>'!r} is wrapped by FSDP1 (FullyShardedDataParallel), "
                "whose flat parameters cannot be passed in. Use FSDP2 (torch.distributed.fsdp.fully_shard)."
            )
        if isinstance(m, fsdp.FSDPModule):
            _check_sharded(m, name)
            state = _internal(m, "_get_fsdp_state", where=type(m).__name__)()
            states.setdefault(id(state), state)
    for state in states.values():
        _check_fsdp_state(state)
    return tuple(states.values())


def _check_sharded(m: nn.Module, prefix: str) -> None:
    """FSDP2 leaves plain unsharded parameters in place after a forward without backward, or ``unshard()``."""
    from torch.distributed.tensor import DTensor

    for name, p in m.named_parameters():
        if not isinstance(p, DTensor):
            fqn = f"{prefix}.{name}" if prefix else name
            raise UnsupportedError(
                f"sg.functional: parameter {fqn!r} of an FSDP2 module is unsharded now (found a plain "
                f"{type(p).__name__} of shape {tuple(p.shape)}, expected a sharded DTensor), as FSDP2 leaves it "
                "after a forward without backward or after unshard(). Call model.reshard() first."
            )


def _check_fsdp_state(state: Any) -> None:
    _hook_handles(state)  # raises if the handles are missing
    policy = _internal(state, "_mp_policy", where="FSDPState")
    dtypes = {f: getattr(policy, f, None) for f in ("param_dtype", "reduce_dtype", "output_dtype")}
    if any(d is not None for d in dtypes.values()):
        raise UnsupportedError(
            f"sg.functional: an FSDP2 module has a MixedPrecisionPolicy ({dtypes}), which apply would ignore "
            "(it gathers the parameters itself, in their own dtype). Call fully_shard without mp_policy and "
            "cast the params dict yourself."
        )


def _internal(obj: Any, attr: str, *, where: str) -> Any:
    """``getattr`` for a torch internal, raising a clear error where this torch lacks it."""
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise UnsupportedError(
            f"sg.functional: this torch ({torch.__version__}) has no FSDP2 internal {attr!r} on {where!r}; "
            "sg.functional knows torch 2.11 to 2.13. Pin one of those, or pass an unsharded module."
        ) from None


def _hook_handles(state: Any) -> list[Any]:
    """The ``RemovableHandle``s of the forward pre/post hooks FSDP2 registered for ``state``."""
    handles: dict[int, Any] = {}
    for attr in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        stack = [_internal(state, attr, where="FSDPState")]
        while stack:  # grouped fully_shard([a, b]) keeps a _MultiHandle of per-module handles
            handle = stack.pop()
            if hasattr(handle, "handles"):
                stack.extend(handle.handles)
            else:
                _internal(handle, "hooks_dict_ref", where=type(handle).__name__)
                handles.setdefault(id(handle), handle)
    return list(handles.values())


def _hook_dicts(states: Iterable[Any]) -> list[tuple[dict[int, Any], set[int]]]:
    """Each hook dict that holds FSDP2 forward hooks, with the hook ids to take out of it."""
    by_dict: dict[int, tuple[dict[int, Any], set[int]]] = {}
    for state in states:
        for handle in _hook_handles(state):
            refs = (handle.hooks_dict_ref, *handle.extra_dict_ref)
            for d in (ref() for ref in refs):
                if d is not None and handle.id in d:
                    by_dict.setdefault(id(d), (d, set()))[1].add(handle.id)
    return list(by_dict.values())


@contextlib.contextmanager
def _fsdp_forward_hooks_removed(states: tuple[Any, ...]) -> Iterator[None]:
    """Take FSDP2's forward hooks out of the modules' hook dicts; put them back, in order, on exit.

    The hooks stay registered objects (same ids, same handles), so FSDP2 cannot tell
    they were ever gone; everything else in the dicts (user hooks) keeps running.
    """
    saved: list[tuple[dict[int, Any], list[int], dict[int, Any]]] = []
    try:
        for d, ids in _hook_dicts(states):
            order = list(d)
            saved.append((d, order, {k: d.pop(k) for k in order if k in ids}))
        yield
    finally:
        for d, order, popped in saved:
            _reinsert(d, order, popped)


def _reinsert(d: dict[int, Any], order: list[int], popped: dict[int, Any]) -> None:
    """Put ``popped`` back into ``d`` at their old places; keys added meanwhile go last."""
    current = dict(d)
    d.clear()
    for key in order:
        if key in popped:
            d[key] = popped[key]
        elif key in current:
            d[key] = current.pop(key)
    d.update(current)


def _check_local_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a DTensor among the inputs of an FSDP2 module's apply: FSDP2 runs each
    rank's forward on its own plain batch (``sg.shard`` makes the batch a DTensor)."""
    from torch.distributed.tensor import DTensor

    paths, leaves, _ = flatten_with_paths(list(args), prefix="args")
    more, others, _ = flatten_with_paths(kwargs, prefix="kwargs")
    for where, leaf in zip([*paths, *more], [*leaves, *others]):
        if isinstance(leaf, DTensor):
            raise UnsupportedError(
                f"apply of the FSDP2 (fully_shard) module {type(module).__name__} got a DTensor input at {where}: "
                "FSDP2 runs each rank's forward on its own plain batch, and its parameters carry their "
                "placements. Call the step without sg.shard (sg.static alone adopts an FSDP2 model), or "
                "build the model without fully_shard and give sg.shard a spec (params=sg.fsdp('dp'))."
            )


def _gathered(params: Mapping[str, Tensor], *, fsdp: bool) -> dict[str, Tensor]:
    """``params`` with every DTensor replaced by its full local tensor when the module uses FSDP2."""
    if not fsdp:
        return dict(params)
    from torch.distributed.tensor import DTensor

    return {k: _all_gather(p) if isinstance(p, DTensor) else p for k, p in params.items()}


def _all_gather(p: Any) -> Tensor:
    """The full value of DTensor ``p`` as a local tensor, differentiable back to ``p``.

    The gradient flows back as a reduce-scatter (an all-reduce on replicated mesh
    dims) of each rank's local gradient divided by the mesh size: the mean over
    ranks, which is what FSDP2's own backward gives by default.
    """
    from torch.distributed.tensor import Partial, Replicate

    mesh = p.device_mesh
    full = p.redistribute(mesh, [Replicate()] * mesh.ndim)
    local = full.to_local(grad_placements=[Partial()] * mesh.ndim)
    return _ScaleGrad.apply(local, 1.0 / mesh.size()) if mesh.size() > 1 else local


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by a constant (sum over ranks -> mean)."""

    @staticmethod
    def forward(x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None
