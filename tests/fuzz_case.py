"""The cases of the differential fuzz test of ``sg.static``: what a generated step
is (:class:`Case`), its input templates, and the tensors they are made of."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Box",
    "Case",
    "FreshNan",
    "Leaf",
    "Pair",
    "TBox",
    "TDict",
    "TSeq",
    "TStatic",
    "TTensor",
    "Trio",
    "get_path",
    "make_tensor",
    "materialize",
    "overlapping",
    "storage",
    "walk",
]

Pair = namedtuple("Pair", "first second")
Trio = namedtuple("Trio", "x y z")


class Box:
    """A container sgraph does not know: a pytree leaf that hides a tensor inside."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Box({self.value!r})"


class FreshNan:
    """A static float nan built anew (a distinct object) on every call."""

    def __repr__(self) -> str:
        return "float('nan') (a new object each call)"


# ---------------------------------------------------------------------------
# Input templates


@dataclass
class TDict:
    items: dict[str, Any]
    orders: list[list[str]]  # key order per call


@dataclass
class TSeq:
    kind: type  # list, tuple or a namedtuple class
    children: list[Any]


@dataclass
class TTensor:
    id: int


@dataclass
class TStatic:
    values: list[Any]  # per call


@dataclass
class TBox:
    id: int


@dataclass
class Leaf:
    """A tensor leaf of the inputs: a root (made, kept or fed back) or a view of one."""

    id: int
    arg: int
    path: tuple
    shape: tuple = ()
    dtype: torch.dtype = torch.float32
    layout: str = "contig"
    special: bool = False
    root: int | None = None
    view: str = ""
    init: torch.Tensor | None = None
    in_box: bool = False


@dataclass
class Case:
    """One generated step and everything needed to call it ``calls`` times."""

    seed: int
    source: str
    fn: Callable[..., Any]
    arg_names: list[str]
    args: list[Any]  # templates
    leaves: dict[int, Leaf]
    donated: set[int]  # argument indices
    donate: Any  # what sg.static(donate=...) gets
    retrace: str
    calls: int
    policies: list[list[str]]  # [call][arg] in 'fresh' | 'same' | 'feed'
    mirror_paths: dict[int, tuple]  # arg -> output path of its new value
    kw_orders: list[list[int]]  # [call] -> argument indices passed by keyword, in call order
    exact: dict[tuple, bool]  # output leaf path -> compared bitwise
    expect_capture_error: bool
    has_box: bool
    writes_overlap: bool = False  # writes in place into a tensor whose elements share memory
    notes: list[str] = field(default_factory=list)
    box_objects: dict[int, Box] = field(default_factory=dict)  # the same Box objects on every call

    def inputs(self, call: int, prev_out: Any, prev_roots: dict[int, torch.Tensor]) -> tuple[tuple, dict, dict]:
        """The arguments of call ``call`` (static-side objects), and the root tensors used."""
        g = torch.Generator().manual_seed(self.seed * 1009 + call)
        roots: dict[int, torch.Tensor] = {}
        for leaf in self.leaves.values():
            if leaf.root is None:
                roots[leaf.id] = self._root(leaf, call, prev_out, prev_roots, g)
        tensors = dict(roots)
        for leaf in self.leaves.values():
            if leaf.root is not None:
                tensors[leaf.id] = eval(leaf.view, {"torch": torch}, {"t": tensors[leaf.root]})
        values = [materialize(a, call, tensors, self.box_objects) for a in self.args]
        kw = set(self.kw_orders[call])
        args = tuple(v for i, v in enumerate(values) if i not in kw)
        kwargs = {self.arg_names[i]: values[i] for i in self.kw_orders[call]}
        return args, kwargs, roots

    def _root(self, leaf: Leaf, call: int, prev_out: Any, prev: dict[int, torch.Tensor], g: torch.Generator):
        policy = "fresh" if call == 0 else self.policies[call][leaf.arg]
        if leaf.in_box and policy == "feed":
            policy = "same"
        if policy == "same":
            return prev[leaf.id]
        if policy == "feed":
            return get_path(prev_out, self.mirror_paths[leaf.arg] + leaf.path)
        if leaf.init is not None:  # optimizer params and state: a copy (a "checkpoint load") of the expected value
            return (
                leaf.init.clone() if call == 0 else get_path(prev_out, self.mirror_paths[leaf.arg] + leaf.path).clone()
            )
        return make_tensor(leaf.shape, leaf.dtype, leaf.layout, leaf.special, g)

    def given_back(self, call: int) -> tuple[set[tuple], set[tuple]]:
        """Output paths of call ``call - 1`` that call ``call`` passes back as donated memory:
        fed-back roots of a donated argument, and fed-back roots of an argument that is not
        donated but has a donated view (sg.static cannot know that one when it returns it)."""
        direct, through_view = set(), set()
        for leaf in self.leaves.values():
            if leaf.root is not None or leaf.in_box or self.policies[call][leaf.arg] != "feed":
                continue
            path = self.mirror_paths[leaf.arg] + leaf.path
            if leaf.arg in self.donated:
                direct.add(path)
            elif any(v.root == leaf.id and v.arg in self.donated for v in self.leaves.values()):
                through_view.add(path)
        return direct, through_view

    def describe(self) -> str:
        """A short text of the case: the step's source, options, inputs per call."""
        lines = [f"--- generated case, seed {self.seed} ---", self.source.rstrip()]
        lines.append(
            f"sg.static(step, donate={self.donate!r}, retrace={self.retrace!r}); donated args: "
            f"{sorted(self.arg_names[i] for i in self.donated)}; {self.calls} calls"
        )
        for leaf in self.leaves.values():
            lines.append("  " + self._describe_leaf(leaf))
        for i, node in enumerate(self.args):
            statics = _statics(node, self.arg_names[i])
            for path, values in statics:
                lines.append(f"  static {path}: {values!r}")
        for call in range(1, self.calls):
            how = ", ".join(f"{self.arg_names[i]}={p}" for i, p in enumerate(self.policies[call]))
            kw = [self.arg_names[i] for i in self.kw_orders[call]]
            lines.append(f"  call {call}: {how}; by keyword {kw}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _describe_leaf(self, leaf: Leaf) -> str:
        where = self.arg_names[leaf.arg] + "".join(f"[{k!r}]" for k in leaf.path)
        if leaf.in_box:
            where += ".value (inside a Box)"
        if leaf.root is not None:
            root = self.leaves[leaf.root]
            rw = self.arg_names[root.arg] + "".join(f"[{k!r}]" for k in root.path)
            return f"{where} = {leaf.view.replace('t', rw, 1) if leaf.view.startswith('t') else leaf.view}  (alias)"
        dt = str(leaf.dtype).replace("torch.", "")
        extra = " with nan/inf/-0.0" if leaf.special and leaf.dtype.is_floating_point else ""
        src = "optimizer init" if leaf.init is not None else "random"
        return f"{where}: {dt}{list(leaf.shape)} {leaf.layout}{extra} ({src})"


def _statics(node: Any, prefix: str) -> list[tuple[str, list]]:
    if isinstance(node, TStatic):
        return [(prefix, node.values)]
    if isinstance(node, TDict):
        return [s for k, c in node.items.items() for s in _statics(c, f"{prefix}[{k!r}]")]
    if isinstance(node, TSeq):
        return [s for i, c in enumerate(node.children) for s in _statics(c, f"{prefix}[{i}]")]
    return []


def materialize(node: Any, call: int, tensors: dict[int, torch.Tensor], boxes: dict[int, Box]) -> Any:
    """Build one argument of call ``call`` from its template."""
    if isinstance(node, TTensor):
        return tensors[node.id]
    if isinstance(node, TBox):
        box = boxes.setdefault(node.id, Box(None))  # the same Box object on every call
        box.value = tensors[node.id]
        return box
    if isinstance(node, TStatic):
        value = node.values[call]
        return float("nan") if isinstance(value, FreshNan) else value
    if isinstance(node, TDict):
        return {k: materialize(node.items[k], call, tensors, boxes) for k in node.orders[call]}
    if isinstance(node, TSeq):
        children = [materialize(c, call, tensors, boxes) for c in node.children]
        return node.kind(*children) if hasattr(node.kind, "_fields") else node.kind(children)
    return node  # None


def get_path(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree.value if key == ".value" else tree[key]
    return tree


def walk(tree: Any, path: tuple = ()):
    """Yield ``(path, leaf)`` for every leaf, descending into dicts, sequences and Boxes."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from walk(v, path + (i,))
    elif isinstance(tree, Box):
        yield from walk(tree.value, path + (".value",))
    else:
        yield path, tree


# ---------------------------------------------------------------------------
# Tensors


SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0, 0.0)
DEVICE = "cpu"  # where the cases' tensors live (drawn on the CPU, from the same seeds, then moved)


def make_tensor(shape: tuple, dtype: torch.dtype, layout: str, special: bool, g: torch.Generator) -> torch.Tensor:
    """A random tensor of ``shape`` laid out as ``layout`` (contig, t, strided, offset, expand)."""
    n = len(shape)
    if layout == "t" and n >= 2:
        return _values(shape[::-1], dtype, special, g).permute(*reversed(range(n)))
    if layout == "strided" and n >= 1:
        return _values(shape[:-1] + (shape[-1] * 2,), dtype, special, g)[..., ::2]
    if layout == "offset" and n >= 1:
        return _values((shape[0] + 1,) + shape[1:], dtype, special, g)[1:]
    if layout == "expand" and n >= 1:
        return _values((1,) + shape[1:], dtype, special, g).expand(*shape)
    return _values(shape, dtype, special, g)


def _values(shape: tuple, dtype: torch.dtype, special: bool, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool().to(DEVICE)
    if dtype == torch.int64:
        return torch.randint(-4, 5, shape, generator=g).to(DEVICE)
    t = torch.randn(shape, generator=g, dtype=dtype)
    if special and t.numel():
        flat = t.view(-1)
        for _ in range(max(1, t.numel() // 4)):
            i = int(torch.randint(0, t.numel(), (), generator=g))
            flat[i] = SPECIALS[int(torch.randint(0, len(SPECIALS), (), generator=g))]
    return t.to(DEVICE)


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def overlapping(t: torch.Tensor) -> bool:
    """Whether ``t``'s layout maps several elements to one address (an expanded tensor), empty or not."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())) or torch._debug_has_internal_overlap(t) == 1
