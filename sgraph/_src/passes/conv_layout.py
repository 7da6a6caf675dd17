"""Run a step's 2-D convolutions on channels-last (NHWC) tensors, under ``sg.fuse``.

cuDNN's fast convolution kernels take NHWC tensors. Given NCHW ones (a model's
default layout) it transposes its arguments into NHWC and its result back, one
transpose kernel each, forward and backward: on the benchmark's ResNet a fifth of the
step. ``torch.compile`` avoids them through Inductor's layout optimization, which lays
the forward's convolutions out channels-last and hands the backward graph the saved
tensors as they came out of the forward. In sgraph's one graph of forward, backward
and update, Inductor re-derives every node's layout from the inputs' (NCHW), and its
lowering of ``convolution_backward`` keeps the arguments in those layouts.

This pass does what a user would do by hand with ``model.to(memory_format=
torch.channels_last)`` and the same for the batch, inside the graph: each argument of
a convolution that is not computed from another convolution (a weight, the batch) is
copied into channels-last, and the forward's convolutions, the normalizations and
activations after them and the backward's convolutions then all run channels-last,
as they would eagerly on such tensors. Arguments still not channels-last after that
(an activation reshaped in between) are copied too, as Inductor's layout optimization
would. What the user sees keeps its layout: a weight's gradient leaves the backward
convolution channels-last and is copied back into the weight's layout before anything
else reads it (as autograd's gradient accumulation does), and the step's outputs keep
the strides they had. The values are the same ops' values on other strides; the sums
inside a convolution may round differently, as under ``torch.compile``.

Applied where Inductor's own rule for a training graph would lay the convolutions out
channels-last (none grouped, not all of them small), on the CPU as on the GPU;
``sg.fuse(channels_last=False)`` keeps the traced layouts.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
import torch.fx

from ..program import Program, fake_mode, output_node, returned

__all__ = ["channels_last"]

Node = torch.fx.Node
aten = torch.ops.aten
_CONV = aten.convolution.default
_CONV_BACKWARD = aten.convolution_backward.default
_ROUNDS = 3


def channels_last(program: Program) -> Program:
    """``program`` with its 2-D convolutions on channels-last tensors (in a copy of its
    graph), where Inductor's layout rule for training graphs picks that layout; else
    ``program`` itself.

    Example:
        >>> lowered = channels_last(program)
        >>> [n.meta["val"].is_contiguous(memory_format=torch.channels_last)
        ...  for n in lowered.graph.nodes if n.target is torch.ops.aten.convolution.default]
        [True, True]
    """
    if not _convolutions(program.graph) or not _inductor_picks_channels_last(program.graph_module):
        return program
    mode = fake_mode(program.graph)
    if mode is None:
        return program
    work = program.copy_graph_module()
    graph = work.graph
    before = {n.name: n.meta.get("val") for n in graph.nodes}
    outputs = [v.meta.get("val") if isinstance(v, Node) else None for v in returned(graph)]
    copies: dict[Node, Node] = {}
    after = _after_a_convolution(graph)
    # A view of what a convolution computed (``x.flatten(1)`` before a linear layer)
    # needs the layout it was traced on: it reads a contiguous copy (dropped below
    # where the tensor stays contiguous).
    guards = _contiguous_before_views(graph, after)
    # First the arguments not computed from a convolution (weights, the batch): the
    # layout then flows from them through the forward and the backward.
    _copy_args(graph, copies, skip=after)
    if not _propagate(work, mode):
        return program
    # Then what is still not channels-last (an activation reshaped in between; a copy
    # changes the layouts after it, hence the rounds).
    for _ in range(_ROUNDS):
        if not _copy_args(graph, copies):
            break
        if not _propagate(work, mode):
            return program
    # The weights' gradients and the step's outputs in the layouts they had.
    restored: dict[Node, Node] = {}
    for node in _convolutions(graph):
        if node.target is _CONV_BACKWARD:
            for grad in [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]:
                if not _restore(graph, grad, before.get(grad.name), restored):
                    return program
    out = output_node(graph)
    for value, old in zip(returned(graph), outputs):
        if isinstance(value, Node) and not _restore(graph, value, old, restored, only=out):
            return program
    for guard in guards:
        if cast(Node, guard.args[0]).meta["val"].is_contiguous():
            guard.replace_all_uses_with(cast(Node, guard.args[0]))
            graph.erase_node(guard)
    if not _propagate(work, mode):
        return program
    now = [v.meta.get("val") if isinstance(v, Node) else None for v in returned(graph)]
    if not all(_same_strides(a, b) for a, b in zip(now, outputs)):
        return program
    graph.lint()
    return program.replace(graph_module=work, passes=program.passes + ("channels_last",))


def _is_2d(node: Node) -> bool:
    weight = node.args[1] if node.target is _CONV else node.args[2]
    val = weight.meta.get("val") if isinstance(weight, Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 4


def _inductor_picks_channels_last(gm: torch.fx.GraphModule) -> bool:
    """Inductor's decision for a training graph (False where this torch has none)."""
    try:
        from torch._inductor.graph import GraphLowering

        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:  # a private rule: without it, the traced layouts stay
        return False


def _convolutions(graph: torch.fx.Graph) -> list[Node]:
    return [n for n in graph.nodes if n.target in (_CONV, _CONV_BACKWARD) and _is_2d(n)]


def _copy_args(graph: torch.fx.Graph, copies: dict[Node, Node], skip: set[Node] | None = None) -> bool:
    """Make each convolution read its arguments that are not channels-last (except
    those in ``skip``) through a channels-last copy; whether any was."""
    changed = False
    for node in _convolutions(graph):
        for index in _layout_args(node):
            arg = node.args[index]
            if isinstance(arg, Node) and not (skip and arg in skip) and not _is_channels_last(arg):
                node.update_arg(index, _copy(graph, arg, torch.channels_last, copies))
                changed = True
    return changed


def _layout_args(node: Node) -> tuple[int, ...]:
    """The positions of the arguments whose layout the convolution's kernel reads:
    input and weight, and the backward's incoming gradient."""
    return (0, 1) if node.target is _CONV else (0, 1, 2)


def _after_a_convolution(graph: torch.fx.Graph) -> set[Node]:
    """The nodes computed (directly or not) from a convolution's result."""
    found: set[Node] = set()
    for node in graph.nodes:
        if node.target in (_CONV, _CONV_BACKWARD) or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _contiguous_before_views(graph: torch.fx.Graph, after: set[Node]) -> list[Node]:
    """Make each view (``aten.view``, which needs strides it can fold) of a contiguous
    value computed from a convolution read a contiguous copy of it; the copies."""
    made: dict[Node, Node] = {}
    for node in [n for n in graph.nodes if n.target in _VIEWS]:
        source = node.args[0]
        val = source.meta.get("val") if isinstance(source, Node) else None
        if source in after and isinstance(val, torch.Tensor) and val.is_contiguous():
            node.update_arg(0, _copy(graph, cast(Node, source), torch.contiguous_format, made))
    return list(made.values())


def _is_channels_last(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous(memory_format=torch.channels_last)


def _copy(graph: torch.fx.Graph, node: Node, memory_format: torch.memory_format, made: dict[Node, Node]) -> Node:
    """One copy of ``node`` in ``memory_format`` (made once, right after ``node``)."""
    if node not in made:
        with graph.inserting_after(node):
            made[node] = graph.call_function(aten.clone.default, (node,), {"memory_format": memory_format})
        made[node].meta = {k: v for k, v in node.meta.items() if k != "val"}
    return made[node]


def _restore(graph: torch.fx.Graph, node: Node, old: Any, made: dict[Node, Node], only: Node | None = None) -> bool:
    """Make every reader of ``node`` (or only ``only``) read it in the layout ``old``
    had; False where that layout is neither contiguous nor channels-last (the pass then
    does not apply)."""
    new = node.meta.get("val")
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor) or _same_strides(new, old):
        return True
    if old.is_contiguous():
        memory_format = torch.contiguous_format
    elif old.dim() == 4 and old.is_contiguous(memory_format=torch.channels_last):
        memory_format = torch.channels_last
    else:
        return False
    copy = _copy(graph, node, memory_format, made)
    node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy and (only is None or user is only))
    return True


def _same_strides(a: Any, b: Any) -> bool:
    """Whether two values lay their elements out alike (the strides of dimensions of
    size 1 do not matter)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)
    if a.shape != b.shape:
        return False
    return all(size == 1 or x == y for size, x, y in zip(a.shape, a.stride(), b.stride()))


def _propagate(gm: torch.fx.GraphModule, mode: Any) -> bool:
    """Every node's ``val`` computed again from the inputs' (the layouts change); False
    where an op refuses the new layouts (the pass then keeps the traced ones: a slower
    step, never a failed one)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    gm.recompile()
    try:
        FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*inputs)
    except (RuntimeError, ValueError):
        return False
    return True
