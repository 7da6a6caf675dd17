"""Differential fuzz test of sg.static: random small steps, each called several times
under sg.static and compared with the same function run eagerly on deep copies of the
same inputs.

A case (see ``fuzz_steps.generate``) is a random step over random pytrees of inputs
(nested dicts in changing key orders, lists, tuples, namedtuples, None, static
leaves such as -0.0 and nan), random ``donate=`` sets, inputs that alias each other,
in-place writes, views, gradients and optimizer updates. Each case runs 3 to 5
calls in the training-loop pattern: the new values of donated (and some other)
arguments are passed back as the next call's inputs, or fresh tensors are.

Per call the checks are:

- the result equals eager's: same pytree structure (container types, dict key
  order, static leaves compared by type and value, -0.0 and nan included), and
  tensors of the same dtype and shape; bitwise (NaN- and sign-of-zero-aware) where
  the values come from exactly-rounded ops only, else within a tolerance (see
  ``TOLERANCE``);
- outputs of the previous call still hold their values (a later call must never
  overwrite an output, unless the user handed it back as a donated input, or eager
  itself writes into it in place);
- inputs that are not donated (and share no memory with a donated one) are unchanged;
- ``trace_count`` is at most the number of distinct signatures seen (no retrace for
  a call whose structure, tensor metadata and static values are all the same);
- a step that writes into an input that is not donated raises ``sg.CaptureError``.

sg.static may raise an ``sg.SgraphError`` instead of returning a result only where
inputs share memory (two inputs alias, or one input's elements overlap, as in an
expanded tensor) or a tensor hides in an unregistered container (a ``Box``); and an
``sg.CaptureError`` where the step writes in place into an expanded view, which a
functional graph cannot express. A different value is always a bug.

Run one case: ``python -c "import sys; sys.path.insert(0, 'tests'); import test_fuzz_static as t; t.run_case(7)"``.
"""

from __future__ import annotations

import copy
import math
import random
import time
import warnings
from collections.abc import Sequence
from typing import Any

import fuzz_case
import pytest
import torch
from fuzz_steps import Box, Case, generate, get_path, overlapping, walk

import sgraph as sg

SEEDS = 300
BLOCK = 10

# Values computed only by exactly-rounded IEEE ops (+ - * /, comparisons, where, views,
# cat...) are compared bitwise: the graph runs the same ATen kernels, and each such op
# gives the one correctly rounded result whatever the layout or vectorization. Values
# from reductions, matmul, transcendentals (SIMD vs scalar tails depend on the strides
# of intermediates), gradients, optimizer updates (fused AdamW kernel) and the
# documented ``p + (x - p) -> x`` fold may round differently, so they get a tolerance
# scaled by the largest magnitude in the tensor.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
# Under sg.fuse every value gets a tolerance: generated code reorders reductions and
# contracts multiply-adds. A float64 value can depend on a float32 one (a global norm
# over float32 and float64 gradients, which scales them all), so it can carry a
# float32-sized error (seed 112: 1e-8 relative in a float64 Adam moment).
FUSED_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-6}


class Mismatch(AssertionError):
    pass


def reproduce(seed: int) -> str:
    return f"python -c \"import sys; sys.path.insert(0, 'tests'); import test_fuzz_static as t; t.run_case({seed})\""


# ---------------------------------------------------------------------------
# Comparing results


def same_static(a: Any, b: Any) -> bool:
    """Static leaves: same type and value, telling -0.0 from 0.0 and nan from anything but nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return False
    ok = ~nan_a
    return bool(((a == b) | nan_a).all()) and torch.equal(a.signbit()[ok], b.signbit()[ok])


def close(a: torch.Tensor, b: torch.Tensor, tolerance: dict = TOLERANCE) -> bool:
    if not a.is_floating_point():
        return torch.equal(a, b)
    if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.isinf(), b.isinf()):
        return False
    finite = a.isfinite() & b.isfinite()
    if not torch.equal(a[~finite & ~a.isnan()], b[~finite & ~b.isnan()]):
        return False  # the same infinities
    if not finite.any():
        return True
    x, y = a[finite].double(), b[finite].double()
    scale = max(1.0, float(y.abs().max()))
    return bool(((x - y).abs() <= tolerance[a.dtype] * scale).all())


def compare(got: Any, want: Any, exact: dict[tuple, bool], path: tuple = (), tolerance: dict = TOLERANCE) -> str | None:
    """The first difference between sg.static's result and eager's, or None."""
    where = "result" + "".join(f"[{k!r}]" for k in path)
    if type(got) is not type(want) and not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return f"{where}: {type(got).__name__} where eager gives {type(want).__name__}"
    if isinstance(want, dict):
        if list(got) != list(want):
            return f"{where}: dict keys {list(got)} where eager gives {list(want)} (order matters)"
        return _first(compare(got[k], want[k], exact, path + (k,), tolerance) for k in want)
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{where}: length {len(got)} where eager gives {len(want)}"
        return _first(compare(g, w, exact, path + (i,), tolerance) for i, (g, w) in enumerate(zip(got, want)))
    if isinstance(want, Box):
        return compare(got.value, want.value, exact, path + (".value",), tolerance)
    if isinstance(want, torch.Tensor):
        return compare_tensor(got, want, exact.get(path, False), where, tolerance)
    if not same_static(got, want):
        return f"{where}: static {got!r} where eager gives {want!r}"
    return None


def compare_tensor(
    got: torch.Tensor, want: torch.Tensor, exact: bool, where: str, tolerance: dict = TOLERANCE
) -> str | None:
    if type(got) is not torch.Tensor:
        return f"{where}: a {type(got).__name__} (not a plain tensor) escaped from the trace"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{where}: {got.dtype}{list(got.shape)} where eager gives {want.dtype}{list(want.shape)}"
    if bitwise(got, want) if exact else close(got, want, tolerance):
        return None
    how = "bitwise" if exact else f"within {tolerance.get(got.dtype)}"
    return f"{where}: values differ ({how}):\n  static {got}\n  eager  {want}"


def _where(path: tuple) -> str:
    return "result" + "".join(f"[{k!r}]" for k in path)


def _first(items: Any) -> str | None:
    return next((x for x in items if x is not None), None)


# ---------------------------------------------------------------------------
# Per-call facts


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def strict_key(args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
    """Everything a correct cache key may depend on: structure with dict key order, tensor
    metadata, static values (-0.0 and nan told apart) and which inputs share memory."""
    key = _key((args, tuple(kwargs.items())))
    sharing = tuple(next((j for j, u in enumerate(tensors) if shares(t, u)), -1) for t in tensors)
    return key, sharing


def _key(x: Any) -> Any:
    if isinstance(x, dict):
        return ("dict", tuple((k, _key(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_key(v) for v in x))
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.stride())
    if isinstance(x, Box):
        return ("box", id(x))
    if isinstance(x, float):
        return ("float", "nan" if math.isnan(x) else x.hex())
    return (type(x), x)


def snapshot(tree: Any) -> list[tuple[tuple, Any]]:
    return [(p, v.clone() if isinstance(v, torch.Tensor) else v) for p, v in walk(tree)]


# ---------------------------------------------------------------------------
# Running one case


class CaseRun:
    """Calls one case's step under sg.static and eagerly, checking every call."""

    def __init__(
        self, case: Case, fuse: bool = False, plan: dict | None = None, mesh: Any = None, split: bool = False
    ) -> None:
        self.case = case
        self.split = _split_arguments(case, mesh.size()) if split else set()
        specs = {case.arg_names[i]: sg.P(mesh.mesh_dim_names[0]) for i in sorted(self.split)}
        fn = sg.plan_memory(**plan)(case.fn) if plan is not None else case.fn
        fn = sg.shard(mesh, **specs)(fn) if mesh is not None else fn
        self.static = sg.static(sg.fuse(fn) if fuse else fn, donate=case.donate, retrace=case.retrace)
        self.mesh = mesh
        # Generated code, and a sum split over ranks, may round differently: tolerance throughout.
        self.exact = {} if fuse or self.split else case.exact
        self.tolerance = FUSED_TOLERANCE if fuse or self.split else TOLERANCE
        self.keys: set[Any] = set()
        self.outcome = "matched"

    def run(self) -> str:
        prev_out, prev_roots, held = None, {}, None
        for call in range(self.case.calls):
            args, kwargs, roots = self.case.inputs(call, prev_out, prev_roots)
            result = self.call(call, args, kwargs, held)
            if result is None:
                break
            prev_out, prev_roots, held = result, roots, (result, snapshot(result), self.donated_now)
            self.prev_want = self.want
        return self.outcome

    def leaves(self, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor, bool]]:
        names = self.case.arg_names
        named = [(names[i], a) for i, a in enumerate(args)] + list(kwargs.items())
        out = []
        for name, value in named:
            donated = int(name[1:]) in self.case.donated
            for path, leaf in walk(value):
                if isinstance(leaf, torch.Tensor):
                    out.append((name + "".join(f"[{k!r}]" for k in path), leaf, donated))
        return out

    def call(self, call: int, args: tuple, kwargs: dict, held: Any) -> Any:
        """One call under sg.static and eagerly; the static result, or None when the case ends
        with an accepted error."""
        leaves = self.leaves(args, kwargs)
        aliased = [(p, q) for i, (p, t, _) in enumerate(leaves) for q, u, _ in leaves[i + 1 :] if shares(t, u)]
        aliased += [(p, p) for p, t, _ in leaves if overlapping(t)]
        self.keys.add(strict_key(args, kwargs, [t for _, t, _ in leaves]))
        self.want, eager_mutated = self.eager(call, args, kwargs, held)
        donated = [t for _, t, d in leaves if d]
        kept = [(p, t, t.clone()) for p, t, d in leaves if not d and not any(shares(t, u) for u in donated)]
        s_args, s_kwargs = self.local(args, kwargs)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = self.static(*s_args, **s_kwargs)
        except sg.SgraphError as e:
            return self.raised(call, e, aliased)
        except Exception as e:
            if self.dtensor_refused(call, e):
                return None
            raise Mismatch(f"call {call}: sg.static raised {type(e).__name__} (not an sg.SgraphError): {e}") from e
        if self.split:  # each result whole, as eager's
            got = torch.utils._pytree.tree_map(lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v, got)
        elif self.mesh is not None:  # the plain tensors came in replicated: their shards go out
            got = torch.utils._pytree.tree_map(lambda v: v.to_local() if hasattr(v, "to_local") else v, got)
        if self.case.expect_capture_error:
            raise Mismatch("call 0: the step writes into an input that is not donated, but no sg.CaptureError")
        diff = compare(got, self.want, self.exact, tolerance=self.tolerance)
        if diff:
            raise Mismatch(f"call {call}: {diff}" + (f" (inputs sharing memory: {aliased})" if aliased else ""))
        if not self.split:  # split: sg.static got copies of this rank's rows, so memory is not compared
            self.check_held(call, held, eager_mutated, donated)
            self.check_kept(call, kept)
        self.check_traces(call)
        self.donated_now = donated
        return got

    def local(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments sg.static gets: under ``split``, this rank's rows (a copy) of each
        split argument's tensors, the rest as they are."""
        if not self.split:
            return args, kwargs
        rank, world = self.mesh.get_local_rank(), self.mesh.size()

        def rows(tree: Any) -> Any:
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.chunk(world)[rank].clone(), tree)

        names = self.case.arg_names
        positional = [i for i in range(len(names)) if names[i] not in kwargs]
        args = tuple(rows(a) if i in self.split else a for i, a in zip(positional, args))
        kwargs = {k: rows(v) if names.index(k) in self.split else v for k, v in kwargs.items()}
        return args, kwargs

    def check_traces(self, call: int) -> None:
        """No retrace for a call whose signature was seen (a Box's tensor may make one, though)."""
        if self.static.trace_count > len(self.keys) and not self.case.has_box:
            raise Mismatch(
                f"call {call}: {self.static.trace_count} traces for {len(self.keys)} distinct signatures "
                "(a call with an identical signature traced again)"
            )

    def eager(self, call: int, args: tuple, kwargs: dict, held: Any) -> tuple[Any, set[tuple]]:
        """Eager's result on deep copies of the inputs (and of the held outputs, so their
        sharing with the inputs is kept), and which held outputs eager wrote into: those
        whose memory an input written in place shares (deep copies of views share storage
        but not version counters, so the inputs' counters are read)."""
        e_args, e_kwargs, e_held = copy.deepcopy((args, kwargs, held[0] if held else None))
        inputs = [t for _, t in walk((e_args, e_kwargs)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = self.case.fn(*e_args, **e_kwargs)
        except Exception as e:
            raise RuntimeError(f"fuzz harness: the eager step raised at call {call}: {e!r}") from e
        written = [t for t, v in zip(inputs, versions) if t._version != v]
        mutated = {p for p, v in walk(e_held) if isinstance(v, torch.Tensor) and any(shares(v, t) for t in written)}
        return want, mutated

    def dtensor_refused(self, call: int, error: Exception) -> bool:
        """Under ``mesh``, whether the trace raised DTensor's own refusal of an op (no
        sharding rule, a rule that fails on a shape eager takes): the case ends there."""
        refusal = (
            "Sharding propagation failed",
            "does not have a sharding strategy",
            "a DTensor with no elements",
            "DTensor computed it on a gathered copy",  # a write into a view of a split dim
        )
        if self.mesh is None or call > 0 or not any(r in str(error) for r in refusal):
            return False
        self.outcome = "DTensor has no rule"
        return True

    def raised(self, call: int, error: Exception, aliased: list) -> None:
        """Accept the error (ending the case) where an sg error is a valid answer, else fail."""
        if self.dtensor_refused(call, error):
            return None
        case = self.case
        if case.expect_capture_error and call == 0 and isinstance(error, sg.CaptureError):
            self.outcome = "CaptureError as expected"
            return None
        if case.writes_overlap and isinstance(error, sg.CaptureError):
            self.outcome = "CaptureError for a write into an expanded view"
            return None
        if aliased or case.has_box:
            why = f"inputs share memory {aliased}" if aliased else "a Box hides a tensor"
            self.outcome = f"raised {type(error).__name__} ({why})"
            return None
        if case.expect_capture_error and call == 0:
            raise Mismatch(f"call 0: expected sg.CaptureError, got {type(error).__name__}: {error}")
        raise Mismatch(f"call {call}: sg.static raised {type(error).__name__}: {error}")

    def check_held(self, call: int, held: Any, eager_mutated: set[tuple], donated: list[torch.Tensor]) -> None:
        """Outputs of the previous call keep their values, except those handed back as
        donated inputs (directly or through a donated view), those eager writes into, and
        an output that is a donated input of the previous call (as documented) whose memory
        is donated again."""
        if held is None:
            return
        result, _, donated_before = held
        objects = [v for _, v in walk(result)]
        slots = {
            id(x) for x in donated_before if sum(o is x for o in objects) == 1 and any(shares(x, d) for d in donated)
        }
        direct, through_view = self.case.given_back(call)
        given = direct | through_view
        boxes = self.case.box_objects.values()
        for path, before in held[1]:
            if not isinstance(before, torch.Tensor) or path in eager_mutated:
                continue
            if any(path[: len(g)] == g for g in given) or self.shared(path, through_view):
                continue
            if ".value" in path and any(get_path(held[0], path[: path.index(".value")]) is b for b in boxes):
                continue  # an input Box returned as it is: the harness itself puts new tensors in it
            now = get_path(held[0], path)
            if id(now) in slots:
                continue
            if not bitwise(now, before):
                why = self.shared(path, given, held)
                raise Mismatch(
                    f"call {call}: the output {_where(path)} of call {call - 1} was overwritten{why}:"
                    f"\n  was {before}\n  now {now}"
                )

    def shared(self, path: tuple, given: set[tuple], held: Any = None) -> str:
        """Whether eager's own result of the previous call had this output share memory with one
        the user handed back as donated; '' if not. With ``held``, also say whether sg.static
        had returned that one in donated memory (the new value of a donated input)."""
        for g in given:
            try:
                a, b = get_path(self.prev_want, path), get_path(self.prev_want, g)
            except (KeyError, IndexError, TypeError, AttributeError):
                continue
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and shares(a, b):
                how = "is the same tensor as" if a is b else "shares memory with"
                text = f" (in eager's result it {how} {_where(g)}, which was passed back as a donated input"
                if held is not None:
                    slot = any(get_path(held[0], g) is x for x in held[2])
                    text += "; sg.static had returned that one " + ("in donated memory" if slot else "as a new tensor")
                return text + ")"
        return ""

    def check_kept(self, call: int, kept: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        for path, now, before in kept:
            if not bitwise(now, before):
                raise Mismatch(f"call {call}: input {path}, not donated, was changed:\n  was {before}\n  now {now}")


def _split_arguments(case: Case, world: int) -> set[int]:
    """The arguments a split run lays out as ``sg.P(axis)`` (dim 0 over the ranks): those
    whose tensors all have a first dim the ranks divide, and share memory with nothing
    (no view of another leaf, no Box); each such argument with probability 3/4."""
    rng = random.Random(case.seed * 7919 + world)
    unsplittable = {leaf.arg for leaf in case.leaves.values() if leaf.root is not None or leaf.in_box}
    unsplittable |= {case.leaves[leaf.root].arg for leaf in case.leaves.values() if leaf.root is not None}
    for leaf in case.leaves.values():
        if not leaf.shape or leaf.shape[0] % world or leaf.shape[0] < world:
            unsplittable.add(leaf.arg)
    having = {leaf.arg for leaf in case.leaves.values()}
    return {i for i in sorted(having - unsplittable) if rng.random() < 0.75}


def run_case(
    seed: int,
    verbose: bool = True,
    fuse: bool = False,
    device: str = "cpu",
    plan: dict | None = None,
    mesh: Any = None,
    split: bool = False,
) -> str:
    """Generate and run case ``seed`` (under sg.fuse too, with ``fuse``; under
    ``sg.plan_memory(**plan)`` too, with ``plan``; under ``sg.shard(mesh)``, every
    argument replicated, with ``mesh``, or with ``split`` some split by rows over the
    mesh's first axis) with its tensors on ``device``; raise AssertionError (with the
    case's text) on a bug."""
    fuzz_case.DEVICE, was = device, fuzz_case.DEVICE
    try:
        case = generate(seed)
        outcome = CaseRun(case, fuse, plan, mesh, split).run()
    except Mismatch as e:
        options = (", fuse=True" if fuse else "") + (f", device={device!r}" if device != "cpu" else "")
        options += f", plan={plan!r}" if plan is not None else ""
        if mesh is not None:  # in a process group of mesh.size() ranks
            options += f", mesh=sg.mesh(dp={mesh.size()})" + (", split=True" if split else "")
        again = reproduce(seed).replace(f"run_case({seed})", f"run_case({seed}{options})")
        raise AssertionError(f"seed {seed}: {e}\n{case.describe()}\nreproduce: {again}") from None
    finally:
        fuzz_case.DEVICE = was
    if verbose:
        print(f"seed {seed}: {outcome}")
    return outcome


@pytest.mark.parametrize("block", range(SEEDS // BLOCK), ids=lambda b: f"seeds{b * BLOCK}-{b * BLOCK + BLOCK - 1}")
def test_static_matches_eager_on_random_steps(block):
    failures = []
    for seed in range(block * BLOCK, (block + 1) * BLOCK):
        try:
            run_case(seed, verbose=False)
        except AssertionError as e:
            failures.append(str(e))
        except Exception as e:  # the harness itself: still name the seed, and go on with the block
            failures.append(f"seed {seed}: fuzz harness error {e!r}\nreproduce: {reproduce(seed)}")
    if failures:
        heads = "\n".join(f.splitlines()[0] for f in failures)
        pytest.fail(f"{len(failures)} of {BLOCK} seeds fail:\n{heads}\n\nfirst failure in full:\n{failures[0]}")


FOUND_SEEDS = [2415, 3264, 3460, 3479, 4378, 4607, 6433, 7035]
# Seeds past the sample that once failed. 3264, 3460, 4378, 4607: an input not donated,
# returned at two places, and passed back donated from one (the other was overwritten);
# 3479, 7035: a write into a view of an expanded view (written back inexactly, NaN beside
# inf); 6433: the same with no elements, which writes nothing and stays allowed;
# 2415: two undonated inputs that were one tensor, both returned, one passed back donated.


def test_static_matches_eager_on_seeds_that_once_failed():
    failures = []
    for seed in FOUND_SEEDS:
        try:
            run_case(seed, verbose=False)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n\n".join(failures)


def run_sample(seeds: Sequence[int], **how: Any) -> None:
    """Run ``seeds`` with ``run_case(seed, **how)``; fail naming every failing seed."""
    failures = []
    for seed in seeds:
        try:
            run_case(seed, verbose=False, **how)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        heads = "\n".join(f.splitlines()[0] for f in failures)
        pytest.fail(f"{len(failures)} of {len(seeds)} seeds fail:\n{heads}\n\nfirst in full:\n{failures[0]}")


FUSED_SEEDS = [*range(24), 34, 64, 108, 147, 210, 266, 349, 1298, 3479, 3580, 4306, 4607, 5467, 7992]
# 34, 64: inputs aliased at trace time; 147: mixed precision (a clipped AdamW over float32
# and float64 params); 108, 349: Lion donated, 266: Nesterov SGD donated; 210: Inductor
# dropped a clone and returned a donated input's buffer; 1298: a donated input took
# another's old value through a view that Inductor dropped, after that one's write;
# 4306: Inductor folded a NaN times an integer zero to zero; 3580, 5467: Inductor refused
# ops over empty tensors (a bool matmul; a mean over an empty bool-float concatenation);
# 7992: a gradient read from a donated moment that AdamW's foreach overwrote, computed
# again by Inductor after the store


@pytest.mark.slow
def test_fused_matches_eager_on_random_steps():
    """A sample of the same cases under sg.static(sg.fuse(step)): generated C++ instead
    of ATen kernels, the same contract (each case compiles with Inductor, hence few)."""
    run_sample(FUSED_SEEDS, fuse=True)


PLAN = {"policy": "save_matmuls"}  # recompute all but matmul outputs: the most copies
PLANNED_SEEDS = [*range(300), 725, 1559]
# 725, 1559: a value returned from an input that the step then wrote in place was
# recomputed after the write


def test_planned_matches_eager_on_random_steps():
    """The cases under sg.static(sg.plan_memory(policy="save_matmuls")(step)): recomputed
    copies and updates scheduled into the backward, bitwise eager's values on ATen kernels."""
    run_sample(PLANNED_SEEDS, plan=PLAN)


SHARDED_SEEDS = range(200)
# run under sg.shard(sg.mesh(dp=world)) by tests/distributed/test_shard_gloo.py (a process
# group is needed); seed 12 (a donated input sharing memory with another) ran unchecked there

SPLIT_SEEDS = [*range(200), 352, 618, 640]
# run there too with split=True on 2 and 4 ranks: some arguments split by rows over the
# mesh; seed 151 wrote into a view of a split dim (a gathered copy), 352, 618 and 640 took
# the gradient of a pending sum


GPU_SEEDS = range(120)


@pytest.mark.gpu
@pytest.mark.slow
def test_static_and_fused_match_eager_on_random_steps_on_the_gpu():
    """The same cases with their tensors on the GPU: sg.static replays a CUDA graph (its
    buffers for inputs laid out as the inputs), and sg.fuse generates Triton code, whose
    foreach kernels over donated state order reads and writes otherwise than C++ code;
    and a sample under plan_memory, whose recomputed copies the graph replays."""
    runs = [
        *((s, {}) for s in GPU_SEEDS),
        *((s, {"fuse": True}) for s in FUSED_SEEDS),
        *((s, {"plan": PLAN}) for s in PLANNED_SEEDS[:60] + PLANNED_SEEDS[-2:]),
    ]
    failures = []
    for seed, how in runs:
        try:
            run_case(seed, verbose=False, device="cuda", **how)
        except AssertionError as e:
            failures.append(str(e))
        except Exception as e:
            failures.append(f"seed {seed} {how}: fuzz harness error {e!r}")
    if failures:
        heads = "\n".join(f.splitlines()[0] for f in failures)
        pytest.fail(f"{len(failures)} cases fail:\n{heads}\n\nfirst in full:\n{failures[0]}")


if __name__ == "__main__":
    import sys

    start = time.perf_counter()
    for s in map(int, sys.argv[1:]):
        try:
            run_case(s)
        except AssertionError as e:
            print(e)
        except Exception as e:
            print(f"seed {s}: fuzz harness error {e!r}")
    print(f"{time.perf_counter() - start:.1f}s")
