"""BatchNorm's running statistics as writes the graph can see.

In training mode ``native_batch_norm`` and ``cudnn_batch_norm`` update the running
mean and variance they are given in place, but their schemas do not mark those
arguments written (``Tensor?``, not ``Tensor(a!)?``). A graph holding
them looks pure where it is not: dead-code elimination drops a batch norm whose
output is unused (``torch.optim.swa_utils.update_bn``'s pattern: run forward, keep
only the new statistics), functionalization leaves the write hidden, and a pass
that recomputes an op would update the statistics twice.

:func:`explicit_running_stats` rewrites each such op of a traced graph into
``_native_batch_norm_legit_functional`` (the same kernel on new tensors, the new
statistics as outputs) followed by ``copy_`` of the new statistics into the tensors
the op wrote; functionalization then turns those copies into ordinary data flow
(or trailing writes into donated inputs) like any other in-place op. cuDNN's
backward op, which reads the forward's reserved workspace, becomes
``native_batch_norm_backward``, which computes the same gradients from the saved
mean and inverse standard deviation (the decomposition torch itself uses).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

__all__ = ["explicit_running_stats", "hidden_writes", "hidden_written_args"]

aten = torch.ops.aten

# forward op -> the backward op that reads its workspace (output 3), if it has one
_FORWARDS = {
    aten.native_batch_norm.default: None,
    aten.cudnn_batch_norm.default: aten.cudnn_batch_norm_backward.default,
}


def hidden_writes(func: object, args: Sequence[object], kwargs: dict[str, object]) -> list[torch.Tensor]:
    """The running statistics a call of ``func`` writes without its schema saying so."""
    if func not in _FORWARDS:
        return []
    names = ("input", "weight", "bias", "running_mean", "running_var", "training")
    values = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
    if not values[5]:
        return []
    return [v for v in values[3:5] if isinstance(v, torch.Tensor)]


def hidden_written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes a graph's batch norm ``node`` writes without its schema saying so."""
    if node.op != "call_function" or node.target not in _FORWARDS:
        return []
    return [v for v in _arguments(node)[3:5] if isinstance(v, torch.fx.Node)] if _arguments(node)[5] else []


def explicit_running_stats(gm: torch.fx.GraphModule) -> bool:
    """Rewrite ``gm``'s training-mode batch norms (see the module docstring); True if any was rewritten."""
    graph = gm.graph
    rewritten = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FORWARDS:
            continue
        x, weight, bias, mean, var, training, momentum, eps = _arguments(node)
        if not training or mean is None or var is None:
            continue  # nothing written
        backward = _FORWARDS[node.target]
        with graph.inserting_after(node):
            functional = graph.call_function(
                aten._native_batch_norm_legit_functional.default, (x, weight, bias, mean, var, True, momentum, eps)
            )
        functional.meta = _carried(node)
        last = functional
        for output, target in ((3, mean), (4, var)):
            with graph.inserting_after(last):
                new = graph.call_function(operator.getitem, (functional, output))
            new.meta = _carried(node)
            with graph.inserting_after(new):
                last = graph.call_function(aten.copy_.default, (target, new))
            last.meta = _carried(node)
        for user in list(node.users):
            index = user.args[1] if user.target is operator.getitem else None
            if index in (0, 1, 2):
                user.args = (functional, index)
            else:
                _rewrite_backwards(graph, user, backward)
        for user in list(node.users):
            if not user.users:
                graph.erase_node(user)
        if node.users:
            raise AssertionError(f"{node.target}: an output used by {list(node.users)} was not rewritten")
        graph.erase_node(node)
        rewritten = True
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _arguments(node: torch.fx.Node) -> tuple[Any, ...]:
    schema = node.target._schema  # type: ignore[union-attr]
    names = [a.name for a in schema.arguments]
    values = list(node.args) + [node.kwargs.get(n) for n in names[len(node.args) :]]
    return tuple(values[:8])


def _rewrite_backwards(graph: torch.fx.Graph, reserve: torch.fx.Node, backward: object) -> None:
    """Replace each backward op reading ``reserve`` (the forward's workspace) by ``native_batch_norm_backward``."""
    for user in list(reserve.users):
        if user.target is not backward:
            raise AssertionError(f"the workspace of a batch norm is read by {user.target}, not {backward}")
        x, grad, weight, mean, var, save_mean, save_invstd, eps = user.args[:8]
        with graph.inserting_after(user):
            native = graph.call_function(
                aten.native_batch_norm_backward.default,
                (grad, x, weight, mean, var, save_mean, save_invstd, True, eps, [True, True, True]),
            )
        native.meta = _carried(user)
        user.replace_all_uses_with(native)
        graph.erase_node(user)


def _carried(node: torch.fx.Node) -> dict[str, object]:
    """``node``'s meta without its value (the new node's value differs; a later trace fills it)."""
    return {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
