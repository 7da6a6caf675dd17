"""Random small train steps for the differential fuzz test of ``sg.static``.

``generate(seed)`` returns a :class:`Case`: the step as real Python source (printed
on a failure, so a case reads like a hand-written reproducer), the recipe for its
inputs on every call (pytree templates, donation, aliasing, outputs fed back as the
next call's inputs) and which output leaves are exact.

How a step is generated: the inputs of call 0 are built first; then the body grows
one line at a time, and each candidate line is executed on (copies of) those inputs
right away. A line that raises is dropped, so shapes and dtypes never need to be
modelled; what ran tells the generator the result's shape, which inputs it wrote
(tensor version counters) and which storages it shares. Inexactness is tracked per
storage: a value computed by a reduction, matmul, transcendental, gradient or
optimizer update, or from such a value, is compared with a tolerance; everything
else is exactly-rounded IEEE arithmetic op by op and is compared bitwise.
"""

from __future__ import annotations

import copy
import linecache
import math
import random
import warnings
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import sgraph as sg

__all__ = ["Box", "Case", "Pair", "Trio", "generate", "get_path", "overlapping", "walk"]

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
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.int64:
        return torch.randint(-4, 5, shape, generator=g)
    t = torch.randn(shape, generator=g, dtype=dtype)
    if special and t.numel():
        flat = t.view(-1)
        for _ in range(max(1, t.numel() // 4)):
            i = int(torch.randint(0, t.numel(), (), generator=g))
            flat[i] = SPECIALS[int(torch.randint(0, len(SPECIALS), (), generator=g))]
    return t


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def overlapping(t: torch.Tensor) -> bool:
    """Whether ``t``'s layout maps several elements to one address (an expanded tensor), empty or not."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())) or torch._debug_has_internal_overlap(t) == 1


# ---------------------------------------------------------------------------
# The generator

BASE_SHAPES = [(3,), (2, 3), (4,), (2, 2, 3), (0, 3), (3, 0), (), (1,), (3, 4)]

UNARY_EXACT = [
    "-{x}",
    "{x}.abs()",
    "{x} * 2",
    "{x} + 1",
    "{x} * 0.5",
    "torch.relu({x})",
    "{x}.clone()",
    "{x}.float()",
    "{x}.double()",
    "{x}.clamp(-1, 1)",
    "~{x}",
    "{x} / 3",
    "{x} * {x}",
    "torch.zeros_like({x})",
    "{x}.to(torch.int64) if not {x}.is_floating_point() else {x} - 0.25",
]
UNARY_DISCRETE = [  # need an exact operand: a rounding difference could flip the result
    "({x} > 0)",
    "torch.nan_to_num({x}).clamp(-9, 9).to(torch.int64)",
    "{x}.bool()",
    "({x} == {x})",
    "torch.isnan({x})",
    "{x}.logical_not()",
    "torch.sign({x})",
]
UNARY_INEXACT = ["torch.tanh({x})", "torch.sin({x})", "torch.exp({x}.clamp(-4, 4))", "torch.sigmoid({x})"]
BINARY = [
    "{x} + {y}",
    "{x} - {y}",
    "{x} * {y}",
    "{x} / {y}",
    "torch.maximum({x}, {y})",
    "torch.minimum({x}, {y})",
    "{x} & {y}",
    "{x} | {y}",
    "{x} + {y} * 2",
    "{x}[0] + {y}",  # ops whose first argument is a view (of an input, often)
    "{x}.t() * {y}",
    "{x}[None] - {y}",
]
BINARY_DISCRETE = ["{x} < {y}", "{x} == {y}"]
REDUCE = [
    "{x}.sum()",
    "{x}.sum(0)",
    "{x}.sum(-1)",
    "{x}.mean()",
    "{x}.mean(0)",
    "{x}.amax(0)",
    "{x}.amin(-1)",
    "{x}.any()",
    "{x}.prod(0)",
    "{x}.sum(0, keepdim=True)",
    "{x}.cumsum(0)",
    "{x}.norm()",
]
REDUCE_EXACT = {"{x}.amax(0)", "{x}.amin(-1)", "{x}.any()"}
MATMUL = ["{x} @ {y}", "{x} @ {x}.t()", "{x}.t() @ {x}", "{x} @ {y}.t()", "torch.outer({x}, {y})"]
VIEWS = [
    "{x}[0]",
    "{x}[-1]",
    "{x}[1:]",
    "{x}[:, 0]",
    "{x}[..., 1:]",
    "{x}.t()",
    "{x}.transpose(0, -1)",
    "{x}.reshape(-1)",
    "{x}.flatten()",
    "{x}.unsqueeze(0)",
    "{x}[None]",
    "{x}.view(-1)",
    "{x}.expand(2, *{x}.shape)",
    "{x}.squeeze()",
    "{x}.narrow(0, 0, 1)",
    "{x}.diagonal()",
    "{x}[::2]",
    "{x}.reshape(2, -1)",
    "{x}.permute(*reversed(range({x}.dim())))",
]
RETURN_VIEWS = ["{x}[0]", "{x}[1:]", "{x}.t()", "{x}.unsqueeze(0)", "{x}[None]", "{x}[..., :1]", "{x}.diagonal()"]
JOIN = ["torch.cat([{x}, {y}])", "torch.cat([{x}, {y}], -1)", "torch.stack([{x}, {y}])", "torch.stack([{x}, {x}], -1)"]
WHERE = ["torch.where({c}, {x}, {y})", "torch.where({c}, {x}, 0.0)", "torch.where({c}, {x}, {x} * 3)"]
INPLACE = [
    "{x}.add_({y})",
    "{x}.mul_(2)",
    "{x}.sub_(1)",
    "{x}.clamp_(-1, 1)",
    "{x}.copy_({y})",
    "{x}[0] = {y}",
    "{x}.neg_()",
    "{x}.abs_()",
    "{x}.masked_fill_({c}, 0)",
    "{x}.fill_(3)",
    "{x}.zero_()",
    "{x}.mul_({y})",
    "{x}[..., :1] = 7",
    "{x} += {y}",
]
INPLACE_INEXACT = ["{x}.tanh_()", "{x}.sin_()"]
INPUT_WRITES = ["{x}.add_({y})", "{x}.mul_(2)", "{x}[0] = {y}", "{x}.copy_({y})", "{x}.zero_()", "{x}.sub_(1)"]
WRITE_VIEWS = [
    "[0]",
    "[1:]",
    "[..., :1]",
    ".t()",
    "[None]",
    ".expand(2, *{x}.shape)",
]  # eager: only zero_/fill_ on expand
DICT_LINES = [
    "torch.cat([v.reshape(-1).double() for v in {d}.values() if isinstance(v, torch.Tensor)])",
    "torch.stack([v.sum().double() for v in {d}.values() if isinstance(v, torch.Tensor)])",
]


class Gen:
    """Builds one Case; every random choice comes from ``rng`` (seeded)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.leaves: dict[int, Leaf] = {}
        self.args: list[Any] = []
        self.arg_kinds: list[str] = []
        self.calls = self.rng.randint(3, 5)
        self.vary = self.rng.random() < 0.5  # static values and dict key orders change between calls
        self.base = self.rng.choice(BASE_SHAPES)
        self.lines: list[str] = []
        self.notes: list[str] = []
        self.counter = 0
        self.has_box = False
        self.opt: tuple[str, int, int] | None = None  # (code, params arg, state arg)
        self.expect_capture_error = False
        self.writes_overlap = False

    # -- inputs ---------------------------------------------------------------

    def shape(self) -> tuple:
        r, b = self.rng.random(), self.base
        if r < 0.55 or not b:
            return b
        if r < 0.7:
            return b[1:]
        if r < 0.8:
            return ()
        if r < 0.9:
            return b[::-1]
        return (self.rng.randint(1, 4),)

    def dtype(self) -> torch.dtype:
        return self.rng.choices([torch.float32, torch.float64, torch.int64, torch.bool], [6, 2, 1.5, 1])[0]

    def new_leaf(self, arg: int, path: tuple, **kw: Any) -> Leaf:
        leaf = Leaf(len(self.leaves), arg, path, **kw)
        self.leaves[leaf.id] = leaf
        return leaf

    def tensor_leaf(self, arg: int, path: tuple) -> Any:
        layout = self.rng.choices(["contig", "t", "strided", "offset", "expand"], [10, 2, 2, 1, 0.7])[0]
        leaf = self.new_leaf(
            arg, path, shape=self.shape(), dtype=self.dtype(), layout=layout, special=self.rng.random() < 0.15
        )
        if self.rng.random() < 0.012:
            leaf.in_box, self.has_box = True, True
            return TBox(leaf.id)
        return TTensor(leaf.id)

    def two_valued(self, first: Any, second: Any) -> list[Any]:
        """Per call ``first`` or ``second`` (at most two signatures, so cached ones are reused)."""
        if not self.vary or self.rng.random() < 0.4:
            return [first] * self.calls
        return [first] + [self.rng.choice([first, second]) for _ in range(1, self.calls)]

    def static_leaf(self) -> TStatic:
        kind = self.rng.choice(["float", "float", "float", "int", "bool", "str", "index"])
        pick = self.rng.choice
        if kind == "float":
            pair = pick(
                [
                    (0.0, -0.0),
                    (-0.0, 0.0),
                    (0.0, -0.0),
                    (FreshNan(), FreshNan()),
                    (FreshNan(), FreshNan()),
                    (math.nan, 2.5),
                    (1.5, -2.0),
                    (1e300, 1.5),
                ]
            )
            return TStatic(self.two_valued(*pair))
        if kind == "int":
            return TStatic(self.two_valued(*pick([(1, 1.0), (1, True), (2, 3), (-1, 2), (True, 1.0)])))
        if kind == "bool":
            return TStatic(self.two_valued(*pick([(True, False), (False, True)])))
        if kind == "str":
            return TStatic(self.two_valued(*pick([("dbl", "neg"), ("neg", "dbl")])))
        return TStatic(self.two_valued(*pick([(0, -1), (-1, 0)])))

    def tree(self, arg: int, path: tuple, depth: int) -> Any:
        r = self.rng.random()
        if depth >= 2 or r < 0.4:
            r = self.rng.random()
            if r < 0.68:
                return self.tensor_leaf(arg, path)
            if r < 0.95:
                return self.static_leaf()
            return None
        kind = self.rng.choice(["dict", "dict", "list", "tuple", "pair", "trio"])
        if kind == "dict":
            keys = self.rng.sample(["w", "b", "x", "y", "m", "v", "k", "s"], self.rng.randint(1, 4))
            return TDict({k: self.tree(arg, path + (k,), depth + 1) for k in keys}, self.dict_orders(keys))
        size = {"pair": 2, "trio": 3}.get(kind, self.rng.randint(1, 3))
        cls = {"pair": Pair, "trio": Trio, "list": list, "tuple": tuple}[kind]
        return TSeq(cls, [self.tree(arg, path + (i,), depth + 1) for i in range(size)])

    def dict_orders(self, keys: list[str]) -> list[list[str]]:
        return self.two_valued(self.rng.sample(keys, len(keys)), self.rng.sample(keys, len(keys)))

    def make_args(self) -> None:
        for i in range(self.rng.randint(1, 4)):
            if self.rng.random() < 0.3:
                self.args.append(self.tensor_leaf(i, ()))
            else:
                self.args.append(self.tree(i, (), 0))
            self.arg_kinds.append("plain")
        if self.rng.random() < 0.4:  # a plain Python number or string argument, like a learning rate
            self.args.append(self.static_leaf())
            self.arg_kinds.append("plain")
        if not any(leaf.root is None for leaf in self.leaves.values()):
            self.args.append(self.tensor_leaf(len(self.args), ()))
            self.arg_kinds.append("plain")
        if self.rng.random() < 0.15:
            self.make_optimizer_args()
        if self.rng.random() < 0.3:
            for _ in range(self.rng.randint(1, 2)):
                self.make_alias()

    def make_optimizer_args(self) -> None:
        kind = self.rng.choice(["sgd", "adamw", "adamw_clip"])
        code = {
            "sgd": "sg.optim.sgd(0.1, momentum=0.9)",
            "adamw": "sg.optim.adamw(1e-2, weight_decay=0.01)",
            "adamw_clip": "sg.optim.chain(sg.optim.clip_by_global_norm(1.0), sg.optim.adamw(1e-2))",
        }[kind]
        opt = eval(code, {"sg": sg})
        p_arg = len(self.args)
        keys = self.rng.sample(["w", "b", "u"], self.rng.randint(1, 3))
        params = {}
        for k in keys:
            shape = self.rng.choice([self.base, (3,), (2, 3), ()])
            layout = self.rng.choices(["contig", "t", "strided"], [8, 1, 1])[0]
            params[k] = make_tensor(
                shape, self.rng.choice([torch.float32, torch.float32, torch.float64]), layout, False, self.g
            )
        self.args.append(self.template_of(params, p_arg, ()))
        self.arg_kinds.append("params")
        state = opt.init(params)
        self.args.append(self.template_of(state, p_arg + 1, ()))
        self.arg_kinds.append("opt_state")
        self.opt = (code, p_arg, p_arg + 1)

    def template_of(self, value: Any, arg: int, path: tuple) -> Any:
        """A template whose call-0 value is ``value`` (optimizer params and state)."""
        if isinstance(value, torch.Tensor):
            layout = "contig" if value.is_contiguous() else "strided"
            leaf = self.new_leaf(arg, path, shape=tuple(value.shape), dtype=value.dtype, layout=layout, init=value)
            return TTensor(leaf.id)
        if isinstance(value, dict):
            keys = list(value)
            return TDict({k: self.template_of(v, arg, path + (k,)) for k, v in value.items()}, [keys] * self.calls)
        if isinstance(value, (list, tuple)):
            children = [self.template_of(v, arg, path + (i,)) for i, v in enumerate(value)]
            return TSeq(type(value), children)
        return TStatic([value] * self.calls) if value is not None else None

    def make_alias(self) -> None:
        roots = [leaf for leaf in self.leaves.values() if leaf.root is None and not leaf.in_box]
        if not roots:
            return
        root = self.rng.choice(roots)
        view = self.rng.choice(["t", "t", "t[1:]", "t[:1]", "t[0]", "t.t()", "t.unsqueeze(0)", "t[-1:]", "t[::2]"])
        try:
            probe = eval(view, {}, {"t": make_tensor(root.shape, root.dtype, root.layout, False, self.g)})
        except Exception:
            return
        arg = self.rng.randrange(len(self.args))
        node = self.args[arg]
        key = f"al{len(self.leaves)}"
        if isinstance(node, TDict) and self.arg_kinds[arg] == "plain":
            path = (key,)
            node.items[key] = TTensor(-1)
            at = self.rng.randint(0, len(node.items) - 1)
            node.orders = [order[:at] + [key] + order[at:] for order in node.orders]
        else:
            arg, path = len(self.args), ()
            self.args.append(None)
            self.arg_kinds.append("alias")
        leaf = self.new_leaf(arg, path, shape=tuple(probe.shape), dtype=probe.dtype, root=root.id, view=view)
        if path:
            self.args[arg].items[key] = TTensor(leaf.id)
        else:
            self.args[arg] = TTensor(leaf.id)

    # -- options and calls ------------------------------------------------

    def choose_donation(self) -> None:
        n = len(self.args)
        self.donated = set()
        for i, kind in enumerate(self.arg_kinds):
            p = 0.7 if kind in ("params", "opt_state") else 0.35
            if self.rng.random() < p and self.has_tensors(i):
                self.donated.add(i)
        self.mirrored = {
            i
            for i in range(n)
            if self.arg_kinds[i] in ("params", "opt_state")
            or (
                self.has_tensors(i)
                and self.arg_kinds[i] == "plain"
                and self.rng.random() < (0.85 if i in self.donated else 0.2)
            )
        }
        names = [f"a{i}" for i in range(n)]
        items = [self.rng.choice([names[i], i]) for i in sorted(self.donated)]
        self.rng.shuffle(items)
        self.donate: Any = items[0] if len(items) == 1 and self.rng.random() < 0.5 else tuple(items)

    def has_tensors(self, arg: int) -> bool:
        return any(leaf.arg == arg and not leaf.in_box for leaf in self.leaves.values())

    def choose_policies(self) -> list[list[str]]:
        policies = [["fresh"] * len(self.args)]
        for _ in range(1, self.calls):
            row = []
            for i, kind in enumerate(self.arg_kinds):
                if kind == "opt_state" or kind == "params":
                    row.append("feed" if self.rng.random() < 0.85 else "fresh")
                elif i in self.mirrored:
                    row.append("feed" if self.rng.random() < 0.75 else "fresh")
                elif i in self.donated:
                    row.append("fresh")
                else:
                    row.append("same" if self.rng.random() < 0.5 else "fresh")
            policies.append(row)
        return policies

    def choose_keywords(self) -> list[list[int]]:
        n = len(self.args)
        k = self.rng.choice([0, 0, 0, 1, 2]) if n > 1 else 0
        tail = list(range(n - k, n))
        orders = []
        for _ in range(self.calls):
            order = list(tail)
            if self.rng.random() < 0.2:
                self.rng.shuffle(order)
            orders.append(order)
        return orders

    # -- the body -----------------------------------------------------------

    def start_body(self, call0: tuple) -> None:
        args, kwargs = copy.deepcopy(call0)
        values = list(args) + [None] * (len(self.args) - len(args))
        for name, v in kwargs.items():
            values[int(name[1:])] = v
        self.ns: dict[str, Any] = dict(self.globals())
        for i, v in enumerate(values):
            self.ns[f"a{i}"] = v
        self.inputs: dict[int, torch.Tensor] = {}
        self.vals: list[str] = []
        self.statics: list[tuple[str, TStatic]] = []
        self.dicts: list[str] = []
        for i, node in enumerate(self.args):
            self.collect(node, f"a{i}")
        self.tainted: set[int] = set()
        self.producer: dict[str, tuple] = {}
        self.written: set[int] = set()

    def globals(self) -> dict[str, Any]:
        ns = {"torch": torch, "sg": sg, "Pair": Pair, "Trio": Trio, "Box": Box, "math": math}
        if self.opt is not None:
            ns["OPT"] = eval(self.opt[0], {"sg": sg})
        return ns

    def collect(self, node: Any, expr: str) -> None:
        if isinstance(node, TTensor):
            self.inputs[node.id] = eval(expr, self.ns)
            self.vals.append(expr)
        elif isinstance(node, TBox):
            self.inputs[node.id] = eval(expr, self.ns).value
            self.vals.append(expr + ".value")
        elif isinstance(node, TStatic):
            self.statics.append((expr, node))
        elif isinstance(node, TDict):
            self.dicts.append(expr)
            for k, c in node.items.items():
                self.collect(c, f"{expr}[{k!r}]")
        elif isinstance(node, TSeq):
            fields = getattr(node.kind, "_fields", None)
            for i, c in enumerate(node.children):
                self.collect(c, f"{expr}.{fields[i]}" if fields else f"{expr}[{i}]")

    def obj(self, expr: str) -> Any:
        return eval(expr, self.ns)

    def exact(self, t: torch.Tensor) -> bool:
        return not isinstance(t, torch.Tensor) or t.numel() == 0 or storage(t) not in self.tainted

    def pick(self, exact_only: bool = False, pred: Callable[[torch.Tensor], bool] | None = None) -> str | None:
        options = [e for e in self.vals if (not exact_only or self.exact(self.obj(e)))]
        if pred is not None:
            options = [e for e in options if pred(self.obj(e))]
        return self.rng.choice(options) if options else None

    def fresh_name(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def allowed_writes(self, written: set[int], line_may_write_plain: bool) -> bool:
        """Writes into donated inputs are fine; into others only where they alias a donated one,
        or on the one line meant to make the step raise CaptureError."""
        donated = {i for i in written if self.leaves[i].arg in self.donated}
        for i in written - donated:
            if line_may_write_plain:
                continue
            t = self.inputs[i]
            if not any(t.numel() and storage(t) == storage(self.inputs[j]) for j in donated):
                return False
        return True

    def run_line(
        self, code: str, target: str | None, operands: list[str], inexact: bool, may_write_plain: bool = False
    ) -> bool:
        """Execute a candidate line; keep it if it runs and writes only where allowed."""
        before = {i: t._version for i, t in self.inputs.items()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(code, self.ns)
        except Exception:
            return False
        written = {i for i, t in self.inputs.items() if t._version != before[i]}
        if not self.allowed_writes(written, may_write_plain):
            return False
        if target is not None and not self.register(target, operands, inexact):
            return False
        if target is None and operands:
            self.taint_write(operands, inexact)
            dest = self.obj(operands[0])
            if isinstance(dest, torch.Tensor) and overlapping(dest):
                self.writes_overlap = True  # into an expanded view: sg.CaptureError is an accepted answer
        self.written |= written
        self.lines.append(code)
        return True

    def register(self, target: str, operands: list[str], inexact: bool) -> bool:
        value = self.ns.get(target)
        if not isinstance(value, torch.Tensor) or value.dim() > 4 or value.numel() > 4096:
            return False
        if inexact and value.is_floating_point() or any(not self.exact(self.obj(o)) for o in operands):
            if value.numel():
                self.tainted.add(storage(value))
        self.vals.append(target)
        return True

    def taint_write(self, operands: list[str], inexact: bool) -> None:
        """An in-place line: its first operand's storage is tainted by the others or the op."""
        dest = self.obj(operands[0])
        if isinstance(dest, torch.Tensor) and inexact or any(not self.exact(self.obj(o)) for o in operands[1:]):
            if dest.numel():
                self.tainted.add(storage(dest))

    def folds(self, x: str, y: str) -> bool:
        """Whether ``x + y`` is ``p + (z - p)``, which sg.static folds to ``z`` (one rounding off)."""
        made = self.producer.get(y)
        return made is not None and made[0] == "sub" and made[2] == x

    def line(self) -> None:
        kinds = ["unary", "binary", "reduce", "matmul", "view", "join", "where", "inplace", "static", "dict"]
        weights = [16, 20, 8, 4, 14, 5, 5, 10, 9, 3]
        kind = self.rng.choices(kinds, weights)[0]
        getattr(self, "line_" + kind)()

    def assign(self, template: str, inexact: bool = False, **slots: str) -> str | None:
        name = self.fresh_name()
        code = f"{name} = {template.format(**slots)}"
        return name if self.run_line(code, name, list(slots.values()), inexact) else None

    def line_unary(self) -> None:
        r = self.rng.random()
        if r < 0.6:
            x = self.pick()
            if x is not None:
                name = self.assign(self.rng.choice(UNARY_EXACT), x=x)
                if name is not None and self.rng.random() < 0.35:
                    self.inplace_on(name)
        elif r < 0.8:
            x = self.pick(exact_only=True)
            if x is not None:
                self.assign(self.rng.choice(UNARY_DISCRETE), x=x)
        else:
            x = self.pick()
            if x is not None:
                self.assign(self.rng.choice(UNARY_INEXACT), inexact=True, x=x)

    def line_binary(self) -> None:
        discrete = self.rng.random() < 0.15
        x, y = self.pick(exact_only=discrete), self.pick(exact_only=discrete)
        if x is None or y is None:
            return
        template = self.rng.choice(BINARY_DISCRETE if discrete else BINARY)
        if template == "{x} / {y}" and not self.exact(self.obj(y)):
            return  # a rounding difference in a divisor near 0 is not bounded by any tolerance
        inexact = template == "{x} + {y}" and self.folds(x, y)
        name = self.assign(template, inexact=inexact, x=x, y=y)
        if name is not None:
            if template == "{x} - {y}":
                self.producer[name] = ("sub", x, y)
            if self.rng.random() < 0.3:
                self.inplace_on(name)

    def line_reduce(self) -> None:
        x = self.pick()
        if x is not None:
            template = self.rng.choice(REDUCE)
            self.assign(template, inexact=template not in REDUCE_EXACT, x=x)

    def line_matmul(self) -> None:
        # eager multiplies empty float32 by float64 matrices, the traced decomposition refuses: skip that quirk
        x = self.pick()
        y = self.pick(pred=lambda t: t.dtype == self.obj(x).dtype) if x is not None else None
        if x is not None and y is not None:
            self.assign(self.rng.choice(MATMUL), inexact=True, x=x, y=y)

    def line_view(self) -> None:
        x = self.pick()
        if x is not None:
            name = self.assign(self.rng.choice(VIEWS), x=x)
            if name is not None and self.rng.random() < 0.25:
                self.inplace_on(name)

    def line_join(self) -> None:
        x, y = self.pick(), self.pick()
        if x is not None and y is not None:
            self.assign(self.rng.choice(JOIN), x=x, y=y)

    def condition(self) -> str | None:
        c = self.pick(exact_only=True, pred=lambda t: t.dtype == torch.bool)
        if c is None or self.rng.random() < 0.4:
            z = self.pick(exact_only=True, pred=lambda t: t.dtype != torch.bool)
            return None if z is None else f"({z} > 0)"
        return c

    def line_where(self) -> None:
        c, x, y = self.condition(), self.pick(), self.pick()
        if c is not None and x is not None and y is not None:
            self.assign(self.rng.choice(WHERE), c=c, x=x, y=y)

    def inplace_on(self, x: str | None = None) -> None:
        """An in-place op on an intermediate (or, through a view, on an input)."""
        if x is None:
            names = [v for v in self.vals if v.startswith("t")]
            x = self.rng.choice(names) if names else self.pick()
        if x is None:
            return
        inexact = self.rng.random() < 0.1
        template = self.rng.choice(INPLACE_INEXACT if inexact else INPLACE)
        y, c = self.pick(), self.condition()
        if "{y}" in template and y is None or "{c}" in template and c is None:
            return
        slots = {k: v for k, v in (("x", x), ("y", y), ("c", c)) if "{" + k + "}" in template}
        inexact = inexact or template in ("{x}.add_({y})", "{x} += {y}") and self.folds(x, str(y))
        self.run_line(template.format(**slots), None, list(slots.values()), inexact)

    def line_inplace(self) -> None:
        self.inplace_on()

    def line_static(self) -> None:
        numeric = [(e, s) for e, s in self.statics if not isinstance(s.values[0], str)]
        strings = [(e, s) for e, s in self.statics if isinstance(s.values[0], str)]
        x = self.pick()
        if x is None or not self.statics:
            return
        if strings and self.rng.random() < 0.3:
            e, s = self.rng.choice(strings)
            template = "({x} * 2) if {s} == 'dbl' else ({x} - 1)"
        elif numeric:
            e, s = self.rng.choice(numeric)
            template = self.rng.choice(
                ["{x} * {s}", "{x} + {s}", "torch.full_like({x}, {s})", "{x}[{s}]", "{x} * {s} + {s}"]
            )
        else:
            return
        self.static_line(template, x, e, s)

    def static_line(self, template: str, x: str, e: str, s: TStatic) -> None:
        """A line reading a static leaf, kept only if it works, same shape and dtype, for every planned value."""
        rhs = template.format(x=x, s="__sv")
        results = []
        for value in s.values:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    v = float("nan") if isinstance(value, FreshNan) else value
                    results.append(eval(rhs, {**self.ns, "__sv": v}))
            except Exception:
                return
        if not all(isinstance(r, torch.Tensor) for r in results):
            return
        if len({(tuple(r.shape), r.dtype) for r in results}) != 1:
            return
        self.assign(template, x=x, s=e)

    def line_dict(self) -> None:
        dicts = [d for d in self.dicts if any(isinstance(v, torch.Tensor) for v in self.obj(d).values())]
        if not dicts:
            return
        d = self.rng.choice(dicts)
        operands = [f"{d}[{k!r}]" for k, v in self.obj(d).items() if isinstance(v, torch.Tensor)]
        template = self.rng.choice(DICT_LINES)
        name = self.fresh_name()
        self.run_line(f"{name} = {template.format(d=d)}", name, operands, inexact="sum" in template)

    def grad_block(self) -> None:
        floats = [e for e in self.vals if self.obj(e).is_floating_point()]
        if not floats:
            return
        chosen = self.rng.sample(floats, min(len(floats), self.rng.randint(1, 2)))
        n = self.fresh_name("")
        keys = [f"p{i}" for i in range(len(chosen))]
        terms = [f"(torch.tanh(p[{k!r}]) * {0.5 + i}).sum()" for i, k in enumerate(keys)]
        terms.append(f"(p[{keys[0]!r}] * p[{keys[0]!r}]).mean()")
        closure = self.pick(pred=lambda t: t.is_floating_point())
        if closure is not None and self.rng.random() < 0.5:
            terms.append(f"p[{keys[0]!r}].sum() * {closure}.sum()")
        aux = self.rng.random() < 0.3
        body = " + ".join(terms)
        ret = f"({body}), {{'a': p[{keys[0]!r}] * 2}}" if aux else body
        arg = "{" + ", ".join(f"{k!r}: {e}" for k, e in zip(keys, chosen)) + "}"
        fn = self.rng.choice(["value_and_grad", "value_and_grad", "grad"])
        head = [f"def loss{n}(p):", f"    return {ret}"]
        if fn == "grad":
            lhs = f"(g{n}, aux{n})" if aux else f"g{n}"
        else:
            lhs = f"(l{n}, aux{n}), g{n}" if aux else f"l{n}, g{n}"
        call = f"{lhs} = sg.{fn}(loss{n}{', has_aux=True' if aux else ''})({arg})"
        if not self.run_line("\n".join(head + [call]), None, [], False):
            return
        outs = [f"g{n}[{k!r}]" for k in keys] + ([f"l{n}"] if fn != "grad" else []) + ([f"aux{n}['a']"] if aux else [])
        for e in outs:
            self.mark_new(e)

    def mark_new(self, expr: str) -> None:
        t = self.obj(expr)
        if t.numel() and t.is_floating_point():
            self.tainted.add(storage(t))
        self.vals.append(expr)

    def optimizer_block(self) -> None:
        _, p, s = self.opt
        n = self.fresh_name("")
        terms = [f"(torch.tanh(v) * {self.rng.choice([0.5, 1.5])}).square().sum() for v in p.values()"]
        body = f"sum({terms[0]})"
        closure = self.pick(pred=lambda t: t.is_floating_point() and t.numel() > 0)
        if closure is not None and self.rng.random() < 0.5:
            body += f" + next(iter(p.values())).sum() * {closure}.mean()"
        code = [
            f"def loss{n}(p):",
            f"    return {body}",
            f"l{n}, g{n} = sg.value_and_grad(loss{n})(a{p})",
            f"u{n}, s{n} = OPT.update(g{n}, a{s}, a{p})",
            f"p{n} = sg.optim.apply_updates(a{p}, u{n})",
        ]
        if not self.run_line("\n".join(code), None, [], False):
            raise AssertionError("the optimizer block failed on its own inputs")
        self.mark_new(f"l{n}")
        for k in self.obj(f"p{n}"):
            self.mark_new(f"p{n}[{k!r}]")
        self.opt_exprs = {p: f"p{n}", s: f"s{n}"}
        for _, leaf in walk(self.obj(f"s{n}")):
            if isinstance(leaf, torch.Tensor) and leaf.numel() and leaf.is_floating_point():
                self.tainted.add(storage(leaf))

    def input_write(self, plain: bool) -> None:
        """Write in place into an input leaf: a donated one, or (``plain``) one not donated."""

        def ok(leaf: Leaf) -> bool:
            return (leaf.arg in self.donated) != plain and leaf.root is None and not leaf.in_box

        targets = [leaf for leaf in self.leaves.values() if ok(leaf)]
        if plain:
            targets = [leaf for leaf in targets if not self.aliased_leaf(leaf)]
        if not targets:
            return
        leaf = self.rng.choice(targets)
        x = self.expr_of(leaf)
        if self.rng.random() < 0.35:
            x = x + self.rng.choice(WRITE_VIEWS).format(x=x)
        template = self.rng.choice(INPUT_WRITES)
        y = self.pick()
        slots = {"x": x, "y": y} if "{y}" in template else {"x": x}
        if None in slots.values():
            return
        if self.run_line(template.format(**slots), None, list(slots.values()), False, may_write_plain=plain):
            if plain and leaf.id in self.written:
                self.expect_capture_error = True
                self.notes.append(f"writes into input {x}, which is not donated: sg.CaptureError expected")

    def aliased_leaf(self, leaf: Leaf) -> bool:
        t = self.inputs[leaf.id]
        return any(j != leaf.id and t.numel() and storage(u) == storage(t) for j, u in self.inputs.items())

    def expr_of(self, leaf: Leaf) -> str:
        for e in self.vals:
            if leaf.id in self.inputs and e.startswith("a") and self.obj(e) is self.inputs[leaf.id]:
                return e
        raise AssertionError(f"no expression for leaf {leaf.id}")

    # -- the return value ----------------------------------------------------

    def mirror(self, node: Any, expr: str, donated: bool) -> str:
        """Code building a tree like input ``node`` (at ``expr``) holding each leaf's new value."""
        if isinstance(node, TDict):
            keys = self.rng.sample(list(node.items), len(node.items))
            items = ", ".join(f"{k!r}: {self.mirror(node.items[k], f'{expr}[{k!r}]', donated)}" for k in keys)
            # {**d, ...} keeps the input's key order, whatever order this call's dict comes in
            return "{" + (f"**{expr}, " if self.rng.random() < 0.35 else "") + items + "}"
        if isinstance(node, TSeq):
            fields = getattr(node.kind, "_fields", None)
            parts = [
                self.mirror(c, f"{expr}.{fields[i]}" if fields else f"{expr}[{i}]", donated)
                for i, c in enumerate(node.children)
            ]
            if fields:
                return f"{node.kind.__name__}({', '.join(parts)})"
            if node.kind is list:
                return f"[{', '.join(parts)}]"
            return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"
        if isinstance(node, TTensor):
            return self.new_value(expr, donated)
        return expr  # statics, Boxes and None come back as they went in

    def new_value(self, e: str, donated: bool) -> str:
        t = self.obj(e)
        r = self.rng.random()
        if r < 0.12:
            return e  # returned unchanged
        if r < 0.3 and donated:
            y = self.pick()
            template = self.rng.choice(["{x}.add_({y})", "{x}.mul_(2)", "{x}.copy_({y})", "{x}[0] = {y}", "{x}.neg_()"])
            slots = {"x": e, "y": y} if "{y}" in template else {"x": e}
            if y is not None or "{y}" not in template:
                inexact = template == "{x}.add_({y})" and self.folds(e, str(y))
                if self.run_line(template.format(**slots), None, list(slots.values()), inexact):
                    return e
        if r < 0.4:
            same = [v for v in self.vals if v != e and self.obj(v).shape == t.shape and self.obj(v).dtype == t.dtype]
            if same:
                return self.rng.choice(same)
        if r < 0.5:  # computed from a view of another value, which may be returned or read too
            like = [
                v for v in self.vals if v != e and self.obj(v).numel() == t.numel() and self.obj(v).dtype == t.dtype
            ]
            if like:
                v = self.rng.choice(like)
                op = self.rng.choice(["+ 1", "* 2", "- {e}"]).format(e=e)
                rhs = f"{v}.reshape({e}.shape) {op}"
                if self.same_kind(rhs, t):
                    name = self.fresh_name("r")
                    if self.run_line(f"{name} = {rhs}", name, [v, e], False):
                        return name
        y = self.pick(pred=lambda u: _broadcasts(u.shape, t.shape))
        if y is not None and t.dtype != torch.bool:
            name = self.fresh_name("r")
            inexact = self.folds(e, y)
            if self.run_line(f"{name} = ({e} + {y}).to({e}.dtype)", name, [e, y], inexact):
                return name
        name = self.fresh_name("r")
        code = f"{name} = ~{e}" if t.dtype == torch.bool else f"{name} = {e} * 2"
        if not self.run_line(code, name, [e], False):
            raise AssertionError(f"no new value for {e}")
        return name

    def same_kind(self, rhs: str, like: torch.Tensor) -> bool:
        """Whether ``rhs`` runs and gives ``like``'s shape and dtype (a value fed back must)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = eval(rhs, dict(self.ns))
        except Exception:
            return False
        return isinstance(value, torch.Tensor) and value.shape == like.shape and value.dtype == like.dtype

    def out_leaf(self) -> str:
        """One leaf of the returned tree: a tensor (maybe a view), a static value or a Box."""
        kinds = ["value", "view", "static", "literal", "dict", "box"]
        kind = self.rng.choices(kinds, [45, 15, 12, 8, 6, 0.8])[0]
        if kind == "static" and self.statics:
            e, _ = self.rng.choice(self.statics)
            return self.rng.choice([e, e, f"({e}, 'tag')", f"{e} * 2"])
        if kind == "dict" and self.dicts:
            d = self.rng.choice(self.dicts)
            return self.rng.choice([f"tuple({d})", f"{{k: v for k, v in {d}.items()}}"])
        if kind == "literal" or not self.vals:
            return self.rng.choice(["'tag'", "3", "-0.0", "None", "(1, 'a')", "True", "float('nan')"])
        x = self.rng.choice(self.vals)
        if kind == "box":
            self.has_box = True
            return f"Box({x})"
        if kind == "view":
            view = self.rng.choice(RETURN_VIEWS).format(x=x)
            try:
                v = self.obj(view)
            except Exception:
                return x
            return view if v.numel() == 0 or storage(v) == storage(self.obj(x)) else x
        return x

    def out_tree(self, depth: int = 0) -> str:
        r = self.rng.random()
        if depth >= 2 or r < 0.5:
            return self.out_leaf()
        n = self.rng.randint(1, 3)
        if r < 0.75:
            keys = self.rng.sample(["loss", "x", "aux", "m", "z", "n"], n)
            return "{" + ", ".join(f"{k!r}: {self.out_tree(depth + 1)}" for k in keys) + "}"
        parts = [self.out_tree(depth + 1) for _ in range(n)]
        if r < 0.85:
            return f"[{', '.join(parts)}]"
        if r < 0.93 and n == 2:
            return f"Pair({parts[0]}, {parts[1]})"
        return f"({', '.join(parts)},)"

    def returns(self) -> tuple[str, dict[int, tuple]]:
        parts: list[tuple[str, int | None]] = []
        for i in sorted(self.mirrored):
            if self.opt is not None and i in self.opt_exprs:
                parts.append((self.opt_exprs[i], i))
            else:
                parts.append((self.mirror(self.args[i], f"a{i}", i in self.donated), i))
        mirrors = list(parts)
        for _ in range(self.rng.randint(0, 2)):
            parts.append((self.out_tree(), None))
        roots = [leaf for leaf in self.leaves.values() if leaf.root is None and not leaf.in_box]
        dups = [(code, leaf) for code, i in mirrors for leaf in roots if leaf.arg == i]
        if dups and self.rng.random() < 0.3:
            code, leaf = self.rng.choice(dups)  # a new value returned a second time, in a metrics dict
            parts.append((f"{{'dup': {_expr_at(code, leaf.path)}}}", None))
        self.rng.shuffle(parts)
        style = self.rng.random()
        if len(parts) == 1 and style < 0.4:
            prefixes: list[tuple] = [()]
            code = parts[0][0]
        elif style < 0.8 or len(parts) != 2:
            prefixes = [(j,) for j in range(len(parts))]
            code = "(" + ", ".join(p for p, _ in parts) + ("," if len(parts) == 1 else "") + ")"
        else:
            keys = self.rng.sample(["state", "params", "metrics", "out", "extra"], len(parts))
            prefixes = [(k,) for k in keys]
            code = "{" + ", ".join(f"{k!r}: {p}" for k, (p, _) in zip(keys, parts)) + "}"
        return code, {i: pre for pre, (_, i) in zip(prefixes, parts) if i is not None}

    # -- assembly -------------------------------------------------------------

    def build(self) -> Case:
        self.make_args()
        self.choose_donation()
        self.policies = self.choose_policies()
        kw_orders = self.choose_keywords()
        proto = self.proto_case(kw_orders)
        call0 = proto.inputs(0, None, {})
        self.start_body(call0[:2])
        self.opt_exprs: dict[int, str] = {}
        if self.opt is not None:
            self.optimizer_block()
        for _ in range(self.rng.randint(2, 8)):
            self.line()
        if self.rng.random() < 0.25:
            self.grad_block()
        if self.donated and self.rng.random() < 0.35:
            self.input_write(plain=False)
        if self.rng.random() < 0.07:
            self.input_write(plain=True)
        ret, mirror_paths = self.returns()
        source = self.source(ret)
        proto.source, proto.mirror_paths = source, mirror_paths
        proto.fn = self.compile(source)
        proto.exact = self.exactness(ret)
        proto.expect_capture_error = self.expect_capture_error
        proto.writes_overlap = self.writes_overlap
        if self.writes_overlap:
            self.notes.append("writes in place into an expanded view: sg.CaptureError accepted")
        proto.has_box = self.has_box
        proto.notes = self.notes
        return proto

    def proto_case(self, kw_orders: list[list[int]]) -> Case:
        return Case(
            seed=self.seed,
            source="",
            fn=lambda: None,
            arg_names=[f"a{i}" for i in range(len(self.args))],
            args=self.args,
            leaves=self.leaves,
            donated=self.donated,
            donate=self.donate,
            retrace=self.rng.choice(["warn", "allow"]),
            calls=self.calls,
            policies=self.policies,
            mirror_paths={},
            kw_orders=kw_orders,
            exact={},
            expect_capture_error=False,
            has_box=self.has_box,
        )

    def source(self, ret: str) -> str:
        head = [f"OPT = {self.opt[0]}"] if self.opt is not None else []
        sig = ", ".join(f"a{i}" for i in range(len(self.args)))
        body = [("    " + ln).replace("\n", "\n    ") for ln in self.lines]
        return "\n".join(head + [f"def step({sig}):"] + body + [f"    return {ret}"]) + "\n"

    def compile(self, source: str) -> Callable[..., Any]:
        filename = f"<fuzz_static seed={self.seed}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        ns = self.globals()
        exec(compile(source, filename, "exec"), ns)
        return ns["step"]

    def exactness(self, ret: str) -> dict[tuple, bool]:
        out = eval(ret, self.ns)
        return {path: self.exact(v) for path, v in walk(out) if isinstance(v, torch.Tensor)}


def _expr_at(code: str, path: tuple) -> str:
    """The sub-expression of the literal ``code`` at ``path`` (indexing past a non-literal)."""
    import ast

    node = ast.parse(code, mode="eval").body
    for n, key in enumerate(path):
        if isinstance(node, ast.Dict):
            node = node.values[[k and ast.literal_eval(k) for k in node.keys].index(key)]
        elif isinstance(node, (ast.Tuple, ast.List)):
            node = node.elts[key]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Pair", "Trio"):
            node = node.args[key]
        else:
            return ast.unparse(node) + "".join(f"[{k!r}]" for k in path[n:])
    return ast.unparse(node)


def _broadcasts(small: torch.Size, big: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(small, big) == big
    except RuntimeError:
        return False


def generate(seed: int) -> Case:
    """The case of ``seed`` (deterministic)."""
    return Gen(seed).build()
