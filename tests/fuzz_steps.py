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
import math
import random
import warnings
from collections.abc import Callable
from typing import Any

import torch
from fuzz_case import (
    Box,
    Case,
    FreshNan,
    Leaf,
    Pair,
    TBox,
    TDict,
    Trio,
    TSeq,
    TStatic,
    TTensor,
    get_path,
    overlapping,
    storage,
    walk,
)
from fuzz_inputs import InputChoices
from fuzz_outputs import OutputChoices
from fuzz_tables import (
    BASE_SHAPES,
    BINARY,
    BINARY_DISCRETE,
    DICT_LINES,
    INPLACE,
    INPLACE_INEXACT,
    INPUT_WRITES,
    JOIN,
    MATMUL,
    REDUCE,
    REDUCE_EXACT,
    UNARY_DISCRETE,
    UNARY_EXACT,
    UNARY_INEXACT,
    VIEWS,
    WHERE,
    WRITE_VIEWS,
)

import sgraph as sg

__all__ = ["Box", "Case", "generate", "get_path", "overlapping", "walk"]


class Gen(InputChoices, OutputChoices):
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
        self.expanded: set[str] = set()  # names of expanded views and of views taken of them

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
            if isinstance(dest, torch.Tensor) and (overlapping(dest) or operands[0] in self.expanded):
                self.writes_overlap = True  # into an expanded view or a view of one: sg.CaptureError is accepted
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
        if overlapping(value) or value._base is not None and any(self._expanded_source(o, value) for o in operands):
            self.expanded.add(target)
        self.vals.append(target)
        return True

    def _expanded_source(self, operand: str, view: torch.Tensor) -> bool:
        source = self.obj(operand)
        if not isinstance(source, torch.Tensor) or not source.numel() or storage(source) != storage(view):
            return False
        return operand in self.expanded or overlapping(source)

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


def generate(seed: int) -> Case:
    """The case of ``seed`` (deterministic)."""
    return Gen(seed).build()
