"""Repeated blocks of a step, compiled once (``sg.fuse``).

A transformer repeats one block: given the whole step as one graph, Inductor lowers,
schedules and generates code for each of its copies, forward and backward. Here the
ops of each copy of a block (the forward ops of one entry of a ``ModuleList`` or
``Sequential``, and apart from them the backward ops of its gradient) are taken out
of the graph into a subgraph, and copies whose ops, constants, shapes and strides
are the same call one shared subgraph through ``invoke_subgraph``, which Inductor
lowers once and calls for each copy.

Which block a node belongs to comes from the module path the tracer stamped on it
(``MODULE_KEY`` for forward ops, ``GRAD_MODULE_KEY`` for backward ones); correctness
does not rest on those labels: a region is taken out only when doing so keeps the
graph's order valid (no outside op both reads from it and feeds it), its outputs
neither alias its inputs nor each other, and it contains no op that writes into its
arguments, draws random numbers (each copy must draw its own) or communicates with
other ranks; copies share a subgraph only when their ops match one for one.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..capture import draws_random_numbers
from ..program import graph_module, memory_root, readers, written_args
from ..source import GRAD_MODULE_KEY, MODULE_KEY

__all__ = ["Outlined", "outline_blocks"]

MIN_OPS = 16
"""Fewer compute ops than this in a block: left inline (a call boundary would cost fusions
for little compile time saved: a Linear of an MLP, say)."""

_INDEX = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Outlined:
    """The graph given to Inductor, with repeated blocks as subgraph calls.

    Attributes:
        gm: the graph module (the input itself when nothing was taken out).
        calls: how many block copies call a shared subgraph.
        subgraphs: how many distinct subgraphs they call.
        members: per call, in graph order: the call node's name, the subgraph it
            calls, and the names of the nodes of ``gm``'s input it computes.
    """

    gm: torch.fx.GraphModule
    calls: int = 0
    subgraphs: int = 0
    members: tuple[tuple[str, str, tuple[str, ...]], ...] = ()


def outline_blocks(gm: torch.fx.GraphModule, min_ops: int = MIN_OPS) -> Outlined:
    """``gm`` with each group of identical block copies calling one shared subgraph.

    Example:
        >>> outlined = outline_blocks(gm)  # gpt-med: 24 calls of 2 subgraphs
        >>> compile_fx(outlined.gm, examples)
    """
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[str, list[_Region]] = {}
    for labelled in _labelled(graph).values():
        region = _region(labelled, order)
        if region is not None and sum(1 for n in region.nodes if n.target is not operator.getitem) >= min_ops:
            groups.setdefault(region.signature, []).append(region)
    shared = [regions for regions in groups.values() if len(regions) > 1]
    if not shared:
        return Outlined(gm)
    out, members = _rebuild(gm, shared, order)
    return Outlined(out, sum(len(r) for r in shared), len(shared), members)


def _labelled(graph: torch.fx.Graph) -> dict[tuple[str, str], list[torch.fx.Node]]:
    """Compute nodes by (block path, "forward" or "backward"), in graph order."""
    found: dict[tuple[str, str], list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for key, side in ((MODULE_KEY, "forward"), (GRAD_MODULE_KEY, "backward")):
            block = _block(node.meta.get(key))
            if block is not None:
                found.setdefault((block, side), []).append(node)
                break
    return found


def _block(path: Any) -> str | None:
    """The path up to the first numbered submodule (``blocks.3.attn`` -> ``blocks.3``)."""
    if not isinstance(path, str) or not path:
        return None
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return None


@dataclass
class _Region:
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]
    views: list[torch.fx.Node]  # views of outputs read outside: made again outside the call
    signature: str


def _region(members: list[torch.fx.Node], order: dict[torch.fx.Node, int]) -> _Region | None:
    """The region of one block copy, or None when it cannot be taken out as a call.

    Its outputs are the values read outside it; where that value is a view (the
    transposed query saved for the backward, say), the call returns the view's base and
    the view is taken again outside, so no two outputs share memory."""
    if any(written_args(n) or not _functional(n) or _draws_random_numbers(n) for n in members):
        return None
    inside = set(members)
    _drop_outer_views(inside, members)
    nodes = [n for n in members if n in inside]
    if not nodes or not _convex(inside, nodes, order):
        return None
    read_outside = [n for n in nodes if any(u not in inside for u in n.users)]
    views = [n for n in read_outside if memory_root(n) is not n]
    if not all(_view_chain_is_closed(v, inside) for v in views):
        return None
    outputs = sorted({memory_root(n) for n in read_outside}, key=order.__getitem__)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    return _Region(nodes, inputs, outputs, views, _signature(nodes, inputs, outputs))


def _view_chain(view: torch.fx.Node) -> list[torch.fx.Node]:
    """The views from ``view``'s memory root down to ``view``, root excluded."""
    chain, root = [], memory_root(view)
    while view is not root:
        chain.append(view)
        view = view.args[0]  # type: ignore[assignment]  # a view's base is its first argument
    return chain[::-1]


def _view_chain_is_closed(view: torch.fx.Node, inside: set[torch.fx.Node]) -> bool:
    """Whether the chain reads nothing of the region but its own links and its root."""
    chain = _view_chain(view)
    known = {memory_root(view), *chain}
    return all(a in known or a not in inside for node in chain for a in node.all_input_nodes)


_COLLECTIVES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")


def _functional(node: torch.fx.Node) -> bool:
    """An op (or a ``getitem`` of one) that writes nothing and communicates with no
    other rank: collectives stay where sg.shard's overlap pass put them."""
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace in _COLLECTIVES:
        return False
    return not node.target._schema.is_mutable


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether the op draws from a generator: Inductor seeds a random op where it lowers
    it, so a call of shared code could draw the same numbers in every copy."""
    return isinstance(node.target, torch._ops.OpOverload) and draws_random_numbers(node.target, node.args, node.kwargs)


def _drop_outer_views(inside: set[torch.fx.Node], members: list[torch.fx.Node]) -> None:
    """Leave out of the region each view of memory made outside it (an output aliasing an
    input would break the subgraph's contract); views of views follow in order."""
    for node in members:
        if node in inside and memory_root(node) is not node and memory_root(node) not in inside:
            inside.discard(node)


def _convex(inside: set[torch.fx.Node], nodes: list[torch.fx.Node], order: dict[torch.fx.Node, int]) -> bool:
    """Whether no outside node both depends on the region and feeds it (else the call
    would have to run before and after that node)."""
    first, last = order[nodes[0]], order[nodes[-1]]
    tainted: set[torch.fx.Node] = set()
    node = nodes[0]
    while node is not None and order.get(node, last + 1) <= last:
        args = node.all_input_nodes
        if node in inside:
            if any(a in tainted for a in args):
                return False
        elif any(a in inside or a in tainted for a in args) and order[node] > first:
            tainted.add(node)
        node = node.next
    return True


def _signature(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> str:
    """A text equal for two regions exactly when one is the other with its inputs renamed:
    the same ops on the same constants, shapes, strides and dtypes, read in the same places."""
    names = {n: f"i{i}" for i, n in enumerate(inputs)}
    names.update({n: f"n{i}" for i, n in enumerate(nodes)})

    def ref(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: _Ref(names[n]))  # type: ignore[arg-type, return-value]

    parts = [";".join(_meta(n.meta.get("val")) for n in inputs)]
    for node in nodes:
        parts.append(f"{node.target}{ref(node.args)!r}{ref(node.kwargs)!r}{_meta(node.meta.get('val'))}")
    parts.append(",".join(names[n] for n in outputs))
    return "\n".join(parts)


class _Ref:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name}"


def _meta(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"<{val.dtype}{tuple(val.shape)}{val.stride()}+{val.storage_offset()}@{val.device}>"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_meta(v) for v in val) + ")"
    return repr(val)


def _rebuild(
    gm: torch.fx.GraphModule, shared: list[list[_Region]], order: dict[torch.fx.Node, int]
) -> tuple[torch.fx.GraphModule, tuple[tuple[str, str, tuple[str, ...]], ...]]:
    """A new graph module whose regions in ``shared`` are subgraph calls (one subgraph per
    group), in a valid order as close to the old one as the calls allow, and its calls
    (see :attr:`Outlined.members`)."""
    root = torch.nn.Module()
    for name, value in gm.named_children():
        root.add_module(name, value)
    of: dict[torch.fx.Node, tuple[int, _Region]] = {}
    for g, regions in enumerate(shared):
        setattr(root, f"sgraph_block_{g}", _subgraph(regions[0]))
        for region in regions:
            of.update((node, (g, region)) for node in region.nodes)
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    members: list[tuple[str, str, tuple[str, ...]]] = []
    for unit in _units_in_order(gm.graph, of, order):
        if isinstance(unit, torch.fx.Node):
            env[unit] = new.node_copy(unit, lambda n: env[n])
            continue
        g, region = unit
        body = new.get_attr(f"sgraph_block_{g}")
        call = new.call_function(
            torch.ops.higher_order.invoke_subgraph, (body, f"sgraph_block_{g}", *(env[n] for n in region.inputs))
        )
        call.meta["val"] = tuple(n.meta.get("val") for n in region.outputs)
        members.append((call.name, f"sgraph_block_{g}", tuple(n.name for n in region.nodes)))
        for i, node in enumerate(region.outputs):
            item = new.call_function(operator.getitem, (call, i))
            item.meta = dict(node.meta)
            env[node] = item
        for view in region.views:
            for link in _view_chain(view):
                if link not in env:
                    env[link] = new.node_copy(link, lambda n: env[n])
    for name, value in _attributes(gm):
        setattr(root, name, value)
    out = graph_module(root, new)
    out.graph.lint()
    return out, tuple(members)


def _attributes(gm: torch.fx.GraphModule) -> Iterable[tuple[str, Any]]:
    """The constants and parameters the graph's ``get_attr`` nodes read."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "." not in str(node.target):
            yield str(node.target), getattr(gm, str(node.target))


def _subgraph(region: _Region) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(region.inputs):
        placeholder = graph.placeholder(f"arg{i}")
        placeholder.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")}
        env[node] = placeholder
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in region.outputs))
    return graph_module(torch.nn.Module(), graph)


def _units_in_order(
    graph: torch.fx.Graph, of: dict[torch.fx.Node, tuple[int, _Region]], order: dict[torch.fx.Node, int]
) -> list[Any]:
    """The nodes outside regions and the regions (as ``(group, region)``), in a valid
    order: each where it first becomes ready, by its earliest node's old position."""
    import heapq

    units: dict[int, Any] = {}
    unit_of: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node in of:
            region = of[node][1]
            key = order[region.nodes[0]]
            units[key] = of[node]
        else:
            key = order[node]
            units[key] = node
        unit_of[node] = key
    waits: dict[int, set[int]] = {key: set() for key in units}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            if unit_of[arg] != unit_of[node]:
                waits[unit_of[node]].add(unit_of[arg])
        for written in written_args(node):  # a write waits for the reads placed before it
            for reader in readers(written):
                if order[reader] < order[node] and unit_of[reader] != unit_of[node]:
                    waits[unit_of[node]].add(unit_of[reader])
    waiting: dict[int, list[int]] = {}
    for key, needs in waits.items():
        for need in needs:
            waiting.setdefault(need, []).append(key)
    ready = [key for key, needs in waits.items() if not needs]
    heapq.heapify(ready)
    left = {key: len(needs) for key, needs in waits.items()}
    result = []
    while ready:
        key = heapq.heappop(ready)
        result.append(units[key])
        for later in waiting.get(key, ()):
            left[later] -= 1
            if left[later] == 0:
                heapq.heappush(ready, later)
    if len(result) != len(units):
        raise AssertionError("a block region was not convex")
    return result
