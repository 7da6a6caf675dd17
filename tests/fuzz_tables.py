"""The op templates a fuzz case's step is built from."""

from __future__ import annotations

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
