"""How a fuzz case's outputs are chosen, and the case assembled from a generated step
(a part of ``fuzz_steps.Gen``)."""

from __future__ import annotations

import linecache
import warnings
from collections.abc import Callable
from typing import Any

import torch
from fuzz_case import Case, Leaf, TDict, TSeq, TTensor, storage, walk
from fuzz_tables import RETURN_VIEWS


class OutputChoices:
    """The output half of :class:`fuzz_steps.Gen`."""

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
