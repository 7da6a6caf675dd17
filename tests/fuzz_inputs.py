"""How a fuzz case's inputs are chosen: pytrees of tensors and static leaves, aliases,
donation, key orders and keywords per call (a part of ``fuzz_steps.Gen``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from fuzz_case import FreshNan, Leaf, Pair, TBox, TDict, Trio, TSeq, TStatic, TTensor, make_tensor

import sgraph as sg


class InputChoices:
    """The input half of :class:`fuzz_steps.Gen`."""

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
        kind = self.rng.choice(["sgd", "adamw", "adamw_clip", "lion", "nesterov"])
        code = {
            "sgd": "sg.optim.sgd(0.1, momentum=0.9)",
            "adamw": "sg.optim.adamw(1e-2, weight_decay=0.01)",
            "adamw_clip": "sg.optim.chain(sg.optim.clip_by_global_norm(1.0), sg.optim.adamw(1e-2))",
            "lion": "sg.optim.lion(1e-3, weight_decay=0.1)",
            "nesterov": "sg.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01)",
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
