"""Match donated inputs to outputs, so each output can be written into one.

A donated input's memory is given to at most one output, and only where nothing
the user can observe changes:

1. A donated input the step returns unchanged keeps its place: it is that output
   (and is given to no other). Unless it comes back only away from its own path
   within its argument (the old value as a metric: ``buffers['mean']`` in,
   ``{'old_mean': buffers['mean']}`` out) and an output fits it by rule 2: then
   that output's value goes into it, and the old value is returned as a copy made
   before anything is written. So the tensors a step returns at the donated
   argument's place keep the addresses a CUDA graph was captured with, call after
   call.
2. Other donated inputs each take the first unmatched output of the same shape,
   dtype and device, preferring the output at the same path within its argument
   (``params['w']`` takes ``result[0]['w']``), then flattening order, as in JAX.
   An input the step already writes in place keeps that write instead. Outputs
   that are inputs returned unchanged are never written into another input.
3. A donated input matched to nothing is reported with a :class:`DonationWarning`;
   so is one whose elements share memory (an expanded view), which cannot hold a
   result of its own shape.

After matching, an output that shares memory with a donated input's new value —
a view of a donated input, or the same value (or a view of it) returned a second
time, say in a metrics dict — is cloned, so the next call's writes into that
input cannot change what the user holds. A step with donated arguments returns no
value twice at all (later places get copies): any output may be passed back as a
donated input on the next call.
"""

from __future__ import annotations

import re
from typing import cast

import torch

from ..errors import DonationWarning, warn
from ..program import LeafInfo, Program, memory_root, output_node, placeholders, returned

__all__ = ["donation"]

Node = torch.fx.Node


def donation(program: Program, *, in_place: bool = False) -> Program:
    """Record ``(output, donated input)`` pairs in ``program.aliases``; clone outputs
    that would share memory with a donated input.

    Args:
        in_place: edit ``program``'s own graph instead of a copy (the pipeline does, on
            the copy of the traced graph it owns).

    Example:
        >>> donation(program).aliases   # output 0 goes into input 0, ...
        ((0, 0), (1, 1))
    """
    written = program.written_inputs()  # of the graph as given: read before any edit
    gm = program.graph_module_to_edit(in_place)
    inputs = placeholders(gm.graph)
    values = returned(gm.graph)
    donated = {inputs[i] for i in program.donated}
    changed = {inputs[i] for i in written}
    _clone_sharing(gm, values, donated, changed, skip=set())  # before matching: a view must not be written anywhere
    aliases = _match(program, values, inputs, written)
    owners = {values[o] for o, _ in aliases if isinstance(values[o], Node)}
    _clone_sharing(gm, values, owners | donated, changed, skip={o for o, _ in aliases})
    if program.donated:
        _clone_repeats(gm, values, changed)
    output_node(gm.graph).args = (values,)
    gm.recompile()
    return program.replace(graph_module=gm, aliases=tuple(aliases), passes=program.passes + ("donation",))


def _match(program: Program, values: list, inputs: list, written: set[int]) -> list[tuple[int, int]]:
    leaves = program.tensor_inputs
    outputs = [o for o in program.outputs if o.is_tensor]
    positions: dict[Node, list[int]] = {}  # output value -> the outputs returning it
    outputs_at = {cast(int, o.graph_index): o for o in outputs}
    for o in outputs:
        positions.setdefault(values[cast(int, o.graph_index)], []).append(cast(int, o.graph_index))
    aliases: list[tuple[int, int]] = []
    used: set[int] = set()
    away: dict[int, int] = {}  # donated input -> where it is returned unchanged, none of them its own path
    for index in sorted(program.donated):
        same = positions.get(inputs[index], [])
        if not same:
            continue
        used.update(same)
        if index in written or any(_at_home(leaves[index], outputs_at[p]) for p in same):
            aliases.append((same[0], index))
        else:
            away[index] = same[0]
    matched = {i for _, i in aliases}
    candidates = _Candidates(outputs, values)
    for index in sorted(program.donated - written - matched):
        overlapping = _overlaps_itself(inputs[index])
        choice = None if overlapping else candidates.choose(leaves[index], used)
        if choice is None and index in away:
            choice = away[index]  # rule 1 after all
        elif choice is None and overlapping:
            _warn_unused(program, index, "its elements share memory (an expanded view), so it cannot hold a result")
        elif choice is None:
            _warn_unused(program, index)
        if choice is not None:
            used.add(choice)
            aliases.append((choice, index))
    return aliases


class _Candidates:
    """The outputs a donated input may receive (none that is an input returned
    unchanged), grouped by shape, dtype and device, and by path within their argument,
    each group in flattening order: a step has hundreds of donated leaves."""

    def __init__(self, outputs: list[LeafInfo], values: list) -> None:
        returned_inputs = {v for v in values if isinstance(v, Node) and v.op == "placeholder"}
        self.fits: dict[tuple, list[int]] = {}
        self.by_path: dict[tuple, list[int]] = {}
        for o in outputs:
            index = cast(int, o.graph_index)
            if values[index] in returned_inputs:
                continue
            key = (o.shape, o.dtype, o.device)
            self.fits.setdefault(key, []).append(index)
            self.by_path.setdefault((key, _within_argument(o.path)), []).append(index)

    def choose(self, leaf: LeafInfo, used: set[int]) -> int | None:
        """The output donated ``leaf`` receives: same path within its argument first, then first fit."""
        key = (leaf.shape, leaf.dtype, leaf.device)
        suffix = _within_argument(leaf.path)
        for group in (self.by_path.get((key, suffix), []) if suffix else [], self.fits.get(key, [])):
            found = next((i for i in group if i not in used), None)
            if found is not None:
                return found
        return None


def _at_home(leaf: LeafInfo, output: LeafInfo) -> bool:
    """Whether ``output`` is at ``leaf``'s own path within its argument."""
    return _within_argument(output.path) == _within_argument(leaf.path)


def _within_argument(path: str) -> str:
    """``params['w']`` -> ``['w']``; ``result[0]['w']`` -> ``['w']`` (the path below the argument)."""
    path = re.sub(r"^result(\[\d+\])?", "", path)
    return re.sub(r"^[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?", "", path) if not path.startswith(("[", ".")) else path


def _overlaps_itself(node: Node) -> bool:
    """Whether two elements of the input may share memory (judged from its strides)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    dims = sorted((stride, size) for size, stride in zip(val.shape, val.stride()) if size > 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            return True
        reach = stride * size
    return False


def _warn_unused(program: Program, index: int, why: str = "") -> None:
    leaf = program.tensor_inputs[index]
    reason = why or "it matches no output of the same shape, dtype and device"
    warn(
        f"{program.name}: donated input {leaf.path} ({leaf.describe()}) is not reused: {reason}. "
        "Return its new value from the step, or stop donating it.",
        DonationWarning,
    )


def _clone_repeats(gm: torch.fx.GraphModule, values: list, changed: set[Node]) -> None:
    """Clone each output whose memory an earlier output already returned: a value
    computed by the step, or an input it returns unchanged (``return x, {"x": x}``),
    which the user may pass back as a donated input from either place."""
    seen: set[Node] = set()
    for i, node in enumerate(values):
        if not isinstance(node, Node):
            continue
        root = memory_root(node)
        if root in seen:
            _clone_at(gm, values, i, changed)
        else:
            seen.add(root)


def _clone_at(gm: torch.fx.GraphModule, values: list, i: int, changed: set[Node]) -> None:
    """Return a clone of output ``i``. A clone of an input the graph writes (one of
    ``changed``) is made at the end, after the write (a step that writes an input in
    place returns its new value); of any other input, at the start, before a donated
    output computed in place in it (:mod:`reinplace`) can change it."""
    node = values[i]
    if node.op != "placeholder":
        where = node
    elif node in changed:
        where = output_node(gm.graph).prev
    else:
        where = placeholders(gm.graph)[-1]
    with gm.graph.inserting_after(where):
        clone = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
    clone.meta = dict(node.meta)
    values[i] = clone


def _clone_sharing(gm: torch.fx.GraphModule, values: list, owners: set, changed: set[Node], skip: set[int]) -> None:
    """Clone each output (other than ``skip``) that is one of ``owners`` or a view of one.

    A donated input returned unchanged at a position not in ``skip`` is cloned too,
    except before matching, where it may still keep its place.
    """
    for i, node in enumerate(values):
        if i in skip or not isinstance(node, Node):
            continue
        if node.op == "placeholder" and not skip:
            continue
        if node in owners or memory_root(node) in owners:
            _clone_at(gm, values, i, changed)
