"""The call path of a transformed step: find the compiled program a call may run.

Every call flattens its arguments (:mod:`argtree`), then tries the cached
:class:`Entry` s of that structure: an entry accepts a call when the global modes,
the static leaves, the tensors' metadata and the module training flags are those
it was traced with. The accepted call's inputs then pass the aliasing check of
:mod:`aliasing` and run. Everything per leaf is either C-level (templates, torch's
tensor check, data pointers) or done once, when the entry is made.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .errors import ArgumentError, ArgumentTypeError, SgraphError, UnsupportedError
from .guards import GlobalState, ModuleFlags, autocast_enabled, autocast_off
from .hidden import find_hidden_tensor
from .signature import Signature, TensorCheck, static_key
from .stages import Compiled

__all__ = ["Entry", "check_call_inputs", "nearest"]


class Entry:
    """A compiled step and the checks a call must pass to run it.

    Args:
        compiled: the compiled step.
        signature: the full signature it was traced for.
        leaves: that call's flat leaves (only metadata is kept).
    """

    def __init__(self, compiled: Compiled, signature: Signature, leaves: Sequence[Any]) -> None:
        self.compiled = compiled
        self.signature = signature
        self.modules: ModuleFlags = signature.modules
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.static_at = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)]
        self.static_keys = [static_key(leaves[i]) for i in self.static_at]
        self._take = _taker(tensor_at)
        tensors = self._take(leaves)
        self.check = TensorCheck(tensors)
        self._closure = compiled.closure if compiled.closure.tensors else None
        self._autocast = autocast_enabled()  # part of the signature's state: the same on every call run here

    def accepts(self, leaves: Sequence[Any], state: GlobalState) -> Sequence[torch.Tensor] | None:
        """The call's tensor leaves if this entry may run it, else None."""
        if state != self.signature.state:
            return None
        for i, key in zip(self.static_at, self.static_keys):
            if static_key(leaves[i]) != key:
                return None
        tensors = self._take(leaves)
        if not self.check.holds(tensors):
            return None
        if self.modules.modules and not self.modules.hold():
            return None
        if self._closure is not None and not self._closure.holds():
            return None
        return tensors

    def first_call(self, leaves: Sequence[Any], state: GlobalState) -> Sequence[torch.Tensor]:
        """The tensors of the call this entry was made for; it must accept them."""
        tensors = self.accepts(leaves, state)
        if tensors is None:
            raise SgraphError(
                f"{self.compiled.program.name}: internal error: the compiled step does not accept the call "
                "it was traced for, so every call would trace again. Please report this."
            )
        return tensors

    def run(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Run on an accepted call's tensors; returns the step's output pytree."""
        if self._autocast:
            with autocast_off():
                return self.compiled.call_tensors(tensors)
        return self.compiled.call_tensors(tensors)


def _taker(positions: list[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    if not positions:
        return lambda leaves: ()
    if len(positions) == 1:
        index = positions[0]
        return lambda leaves: (leaves[index],)
    return operator.itemgetter(*positions)


def nearest(signature: Signature, entries: Sequence[Entry]) -> str:
    """What differs between ``signature`` and the closest cached one, in one line."""
    best, text = None, ""
    for entry in entries:
        now = Signature(
            signature.structure,
            signature.leaves,
            signature.state,
            entry.modules.now(),
            signature.paths,
            signature.names,
        )
        distance = now.distance(entry.signature)
        if best is None or distance < best:
            change = entry.compiled.closure.change() if distance == 0 else None
            best, text = distance, change or now.difference(entry.signature)
    return text


def check_call_inputs(
    api: str, leaves: Sequence[Any], paths: Sequence[str], donated: frozenset[int] = frozenset()
) -> None:
    """Refuse inputs a compiled step cannot honour, naming the leaf's path.

    Args:
        donated: the positions of the donated leaves.

    Raises:
        UnsupportedError: a tensor inside a torch.func transform, a tensor
            that requires grad while grad mode is on, or a sparse tensor.
        ArgumentError: a donated inference tensor outside inference mode (the step
            could not write it).
        ArgumentTypeError: a static argument hides tensors inside an object that is
            not a registered pytree node.
    """
    grad_on = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    for i, (leaf, path) in enumerate(zip(leaves, paths)):
        if isinstance(leaf, torch.Tensor):
            _check_tensor(api, leaf, path, grad_on)
            if i in donated and not inference and leaf.is_inference():
                raise ArgumentError(
                    f"{api}: {path} is donated, but it is an inference tensor (made under "
                    "torch.inference_mode()), which nothing may write outside inference mode. Pass a "
                    "copy made outside it (t.clone()), or call the step under torch.inference_mode()."
                )
        else:
            _check_static(api, leaf, path)


def _check_tensor(api: str, t: torch.Tensor, path: str, grad_on: bool) -> None:
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        raise UnsupportedError(
            f"{api}: {path} comes from a torch.func transform (grad, vmap, jacrev...) applied outside "
            "the static step; a compiled step cannot be differentiated or batched from outside. Apply "
            "the transform inside the step instead: sg.static(torch.func.vmap(f)), or sg.grad inside."
        )
    if grad_on and t.requires_grad:
        raise UnsupportedError(
            f"{api}: {path} requires grad, but gradients do not flow back through a static step "
            "(sg.grad(sg.static(f)) is not supported). Compute gradients inside the step with "
            "sg.grad / sg.value_and_grad, and pass tensors that do not require grad: the params of "
            "sg.functional(model), or .detach(); or call the step under torch.no_grad()."
        )
    if t.layout != torch.strided:
        raise UnsupportedError(f"{api}: {path} is a {t.layout} tensor; sg.static takes dense (strided) tensors.")


def _check_static(api: str, value: Any, path: str) -> None:
    inner = find_hidden_tensor(value)
    if inner is not None:
        raise ArgumentTypeError(
            f"{api}: {path}{inner} is a tensor inside an object of type {type(value).__name__}, which is "
            "not a pytree container, so the step would treat the whole object as a constant. Register the class: "
            f"sg.tree.register_dataclass({type(value).__name__}) for a dataclass, sg.tree.register_node "
            "otherwise; or pass the tensors in a dict, list or tuple."
        )
