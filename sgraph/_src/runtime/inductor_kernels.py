"""Which generated kernel runs which node of a Program, read from Inductor's output.

Inductor records, per compiled graph, where each node of the graph it was given
went (``preToPost``: our node -> its post-grad nodes) and which kernel call runs
each post-grad node (``...CodeToPost``: ``"kernel_name:call_index"`` -> nodes).
Composing the two maps every ATen node of the step to the kernel calls that
compute it. The record lives on Inductor's compiled-graph object (also when it
came from the on-disk cache); a torch that does not keep it gives an empty map,
and the kernel count then comes from the generated ``call`` function's text.
"""

from __future__ import annotations

import json
import linecache
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BlockCode", "Kernel", "KernelMap", "kernel_map", "note_failing_kernel"]


@dataclass(frozen=True)
class Kernel:
    """One kernel call of the generated step: its name, its position among the
    calls, and the Program nodes it computes (in part or whole)."""

    name: str
    index: int
    nodes: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"#{self.index} {self.name}"


@dataclass(frozen=True)
class BlockCode:
    """The shared code of a repeated block: its name in the generated source, how many
    times one step calls it, and the kernel calls one run of it makes, in order
    (a block called from inside it: that block's name, its kernels listed under it)."""

    name: str
    calls: int
    kernels: tuple[str, ...]


@dataclass(frozen=True)
class KernelMap:
    """The kernel calls of one compiled step (``count`` of them per call; ``None``
    when unknown), per Program node name the calls that compute it, and the code of
    the repeated blocks those calls include."""

    kernels: tuple[Kernel, ...] = ()
    count: int | None = None
    of_node: dict[str, tuple[Kernel, ...]] = field(default_factory=dict)
    blocks: tuple[BlockCode, ...] = ()


def kernel_map(compiled: Any, blocks: Sequence[tuple[str, str, tuple[str, ...]]] = ()) -> KernelMap:
    """The kernel map of what ``compile_fx`` returned (empty if it cannot be read).

    Args:
        compiled: what ``compile_fx`` returned.
        blocks: the calls of outlined blocks in the graph compiled (``Outlined.members``):
            their nodes are mapped to the call of the block's code, which is listed
            as one entry with the kernels it runs.
    """
    graph = _output_code(compiled)
    if graph is None:
        return KernelMap()
    if blocks:
        return _with_blocks(graph, blocks)
    mapping = _provenance(graph)
    if mapping is None:
        return KernelMap(count=_count_calls(getattr(graph, "source_code", None) or ""))
    return _mapped(*mapping)


def _mapped(pre_to_post: dict[str, list[str]], code_to_post: dict[str, list[str]]) -> KernelMap:
    post_to_pre: dict[str, list[str]] = {}
    for pre, posts in pre_to_post.items():
        for post in posts:
            post_to_pre.setdefault(post, []).append(pre)
    kernels: list[Kernel] = []
    for key, posts in code_to_post.items():
        name, _, index = key.rpartition(":")
        nodes = dict.fromkeys(pre for post in posts for pre in post_to_pre.get(post, ()))
        kernels.append(Kernel(name, int(index) if index.isdigit() else len(kernels), tuple(nodes)))
    kernels.sort(key=lambda k: k.index)
    of_node: dict[str, list[Kernel]] = {}
    for kernel in kernels:
        for node in kernel.nodes:
            of_node.setdefault(node, []).append(kernel)
    return KernelMap(tuple(kernels), len(kernels), {k: tuple(v) for k, v in of_node.items()})


def _provenance(graph: Any) -> tuple[dict[str, list[str]], dict[str, list[str]]] | None:
    text = getattr(graph, "inductor_provenance_mapping_str", None)
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    code = {}
    for key, value in data.items():
        if key.endswith("CodeToPost") and isinstance(value, dict):
            code.update(value)
    pre = data.get("preToPost")
    if not isinstance(pre, dict) or not code:
        return None
    return pre, code


_CALL = re.compile(
    r"^[ \t]+(?:\w+ = )?(?:(\w+)\.run\(|(extern_kernels\.\w+)\(|(cpp_fused_\w+)\(|(torch\.ops\.\w+\.[\w.]+)\()", re.M
)
"""A kernel call of the generated code (an op's result may be assigned: ``buf8 =
torch.ops.aten._scaled_dot_product_cudnn_attention.default(...)``); its one matching
group is the kernel's name."""
_SUBGRAPH_CALL = re.compile(r"^\s+\w+ = (\w+)\(\1_args\)", re.M)
_DEF = re.compile(r"^\s*def (\w+)\(", re.M)


def _with_blocks(graph: Any, blocks: Sequence[tuple[str, str, tuple[str, ...]]]) -> KernelMap:
    """The kernel map of a step whose repeated blocks call shared code, read from the
    generated source: ``call``'s kernels in order, each block call one entry (named
    after the code it calls, with its kernel count), and each block call's nodes
    mapped to it; the other nodes are mapped through Inductor's provenance, by kernel
    name and occurrence (its record of what runs inside a block's code is not kept
    apart from the step's own)."""
    source = getattr(graph, "source_code", None) or ""
    bodies = _bodies(source)
    if "call" not in bodies:
        return KernelMap()
    kernels: list[Kernel] = []
    seen: dict[str, int] = {}
    calls = iter(blocks)
    count = 0
    for line in bodies["call"].splitlines():
        sub = _SUBGRAPH_CALL.match(line)
        if sub is not None and sub.group(1) in bodies:
            _, _, nodes = next(calls, ("", "", ()))
            inner = _kernel_count(sub.group(1), bodies)
            kernels.append(Kernel(f"{sub.group(1)} ({inner} kernels)", len(kernels) + 1, nodes))
            count += inner
            continue
        found = _CALL.match(line)
        if found is not None:
            name = next(g for g in found.groups() if g)
            seen[name] = seen.get(name, 0) + 1
            kernels.append(Kernel(name, len(kernels) + 1, (f"{name}#{seen[name]}",)))
            count += 1
    named = _provenance_by_occurrence(graph)
    kernels = [
        Kernel(k.name, k.index, named.get(k.nodes[0], ())) if k.nodes and "#" in k.nodes[0] else k for k in kernels
    ]
    of_node: dict[str, list[Kernel]] = {}
    for kernel in kernels:
        for node in kernel.nodes:
            of_node.setdefault(node, []).append(kernel)
    return KernelMap(tuple(kernels), count, {k: tuple(v) for k, v in of_node.items()}, _block_codes(bodies))


def _block_codes(bodies: dict[str, str]) -> tuple[BlockCode, ...]:
    """Each block code the step calls (directly or from another block), with its
    calls per step and its own kernel calls in order."""
    calls: dict[str, int] = {}

    def visit(name: str, times: int, depth: int) -> None:
        for sub in _SUBGRAPH_CALL.finditer(bodies.get(name, "")):
            if sub.group(1) in bodies and depth < 8:
                calls[sub.group(1)] = calls.get(sub.group(1), 0) + times
                visit(sub.group(1), times, depth + 1)

    visit("call", 1, 0)
    found = []
    for name, times in calls.items():
        names = []
        for line in bodies[name].splitlines():
            sub = _SUBGRAPH_CALL.match(line)
            found_call = None if sub is not None else _CALL.match(line)
            if sub is not None and sub.group(1) in bodies:
                names.append(sub.group(1))
            elif found_call is not None:
                names.append(next(g for g in found_call.groups() if g))
        found.append(BlockCode(name, times, tuple(names)))
    return tuple(found)


def _bodies(source: str) -> dict[str, str]:
    """The text of each function defined in the generated source, by name."""
    starts = [(m.start(), m.group(1)) for m in _DEF.finditer(source)]
    ends = [start for start, _ in starts[1:]] + [len(source)]
    return {name: source[start:end] for (start, name), end in zip(starts, ends)}


def _kernel_count(name: str, bodies: dict[str, str], depth: int = 0) -> int:
    """Kernel calls one run of the generated function ``name`` makes, its subgraphs' included."""
    body = bodies.get(name, "")
    inner = [m.group(1) for m in _SUBGRAPH_CALL.finditer(body) if m.group(1) in bodies and depth < 8]
    return len(_CALL.findall(body)) + sum(_kernel_count(sub, bodies, depth + 1) for sub in inner)


def _provenance_by_occurrence(graph: Any) -> dict[str, tuple[str, ...]]:
    """``"kernel_name#k"`` (the k-th call of that name at the step's own level) -> the
    nodes Inductor's provenance says it computes; kernels reading block calls'
    results through their inputs are left out, since their record mixes in the
    block code's own nodes."""
    mapping = _provenance(graph)
    if mapping is None:
        return {}
    plain = _mapped(*mapping)
    found: dict[str, tuple[str, ...]] = {}
    seen: dict[str, int] = {}
    for kernel in plain.kernels:
        if any(n.startswith(("invoke_subgraph", "repeated_subgraph")) for n in kernel.nodes):
            continue
        seen[kernel.name] = seen.get(kernel.name, 0) + 1
        found[f"{kernel.name}#{seen[kernel.name]}"] = tuple(n for n in kernel.nodes if "subgraph" not in n)
    return found


def _count_calls(source: str) -> int | None:
    """Kernel calls in the generated ``call`` function, or None without its text."""
    start = source.find("\ndef call(")
    if start < 0:
        return None
    end = source.find("\ndef ", start + 1)
    return len(_CALL.findall(source[start : end if end > 0 else len(source)]))


def _output_code(compiled: Any, depth: int = 0, seen: set[int] | None = None) -> Any:
    """Inductor's compiled-graph object inside the callable ``compile_fx`` returned
    (its runtime wrappers hold it in closures and attributes)."""
    from torch._inductor.output_code import CompiledFxGraph

    seen = set() if seen is None else seen
    if id(compiled) in seen or depth > 10:
        return None
    seen.add(id(compiled))
    if isinstance(compiled, CompiledFxGraph):
        return compiled
    for inner in _references(compiled):
        found = _output_code(inner, depth + 1, seen)
        if found is not None:
            return found
    return None


def _references(obj: Any) -> list[Any]:
    found: list[Any] = []
    closure = getattr(obj, "__closure__", None)
    if closure:
        for cell in closure:
            try:
                found.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for name in ("func", "__wrapped__"):
        if hasattr(obj, name):
            found.append(getattr(obj, name))
    if isinstance(obj, (list, tuple)):
        found += list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        found += [v for v in vars(obj).values() if not isinstance(v, (str, int, float, bool, type(None)))]
    return found


def note_failing_kernel(error: BaseException, kernels: KernelMap, sources: Mapping[str, Any]) -> None:
    """Add a note to ``error``, raised inside the generated code, naming the kernel
    call that raised and the user's source lines of the nodes it computes (the
    traceback itself ends in Inductor's generated module). ``sources``: each Program
    node's :class:`~sgraph._src.source.Source`, by name. Nothing is added before
    Python 3.11 (no exception notes) or where no kernel call is found."""
    if not hasattr(error, "add_note"):
        return
    name = None
    tb = error.__traceback__
    while tb is not None:
        line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        found = _CALL.match(line)
        if found is not None:
            name = next(g for g in found.groups() if g)
        tb = tb.tb_next
    if name is None:
        return
    places = dict.fromkeys(
        sources[node].describe()
        for kernel in kernels.kernels
        if kernel.name == name
        for node in kernel.nodes
        if sources.get(node) is not None
    )
    if places:
        lines = list(places)
        more = f" and {len(lines) - 3} more" if len(lines) > 3 else ""
        traced = "; ".join(lines[:3]) + more
        error.add_note(f"sgraph: raised by the generated kernel {name}, which computes ops traced from {traced}")
    else:
        error.add_note(
            f"sgraph: raised by the generated kernel {name}; "
            "call the step without sg.fuse to see the line it comes from"
        )
