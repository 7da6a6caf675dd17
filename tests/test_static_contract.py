"""Nothing escapes a trace, nesting works or raises, threads, and errors that teach."""

from __future__ import annotations

import dataclasses
import inspect
import re
import threading

import pytest
import torch
import torch.nn as nn

import sgraph as sg

# --------------------------------------------------------------------------- nothing escapes


@dataclasses.dataclass
class Box:
    value: torch.Tensor
    tag: str = "box"


class TensorList(list):
    pass


@pytest.mark.parametrize(
    "make, where",
    [
        (lambda x: Box(x + 1), "result.value, inside an object of type Box"),
        (lambda x: (x, TensorList([x * 2])), "result[1][0], inside an object of type TensorList"),
        (lambda x: {"out": Box(x)}, "result['out'].value, inside an object of type Box"),
    ],
)
def test_a_tensor_returned_inside_an_unregistered_object_raises_naming_the_path(make, where):
    with pytest.raises(sg.CaptureError, match=re.escape(f"returns a tensor at {where}")) as info:
        sg.static(make)(torch.ones(2))
    assert "sg.tree.register_dataclass" in str(info.value)


def test_a_tensor_passed_inside_an_unregistered_object_raises_naming_the_path():
    with pytest.raises(sg.ArgumentTypeError, match=re.escape("cfg.value is a tensor inside an object of type Box")):
        sg.static(lambda x, cfg: x * cfg.value)(torch.ones(2), Box(torch.ones(2)))


def test_a_registered_dataclass_goes_in_and_out():
    @sg.tree.register_dataclass
    @dataclasses.dataclass
    class State:
        mu: torch.Tensor
        count: int

    step = sg.static(lambda s, g: State(s.mu * 0.9 + g, s.count + 1), retrace="allow")
    out = step(State(torch.ones(2), 0), torch.ones(2))
    assert isinstance(out, State) and out.count == 1 and torch.allclose(out.mu, torch.full((2,), 1.9))
    assert sg.tree.flatten_with_paths(out, prefix="state")[0] == ["state.mu", "state.count"]


# --------------------------------------------------------------------------- nesting


def square_sum(x):
    return (x * x).sum()


def test_grad_of_a_static_step_raises_instead_of_returning_zeros():
    with pytest.raises(sg.UnsupportedError, match=r"sg.grad\(sg.static\(f\)\) is not supported"):
        sg.grad(sg.static(square_sum))(torch.ones(3))


@pytest.mark.parametrize("transform", [torch.func.grad, torch.func.vmap])
def test_torch_func_around_a_static_step_raises(transform):
    with pytest.raises(sg.UnsupportedError, match="torch.func transform"):
        transform(sg.static(lambda x: (x * x).sum()))(torch.ones(3))


def test_torch_func_inside_a_static_step_works():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(sg.static(torch.func.vmap(square_sum))(x), torch.func.vmap(square_sum)(x))
    assert torch.equal(sg.static(torch.func.grad(square_sum))(x), 2 * x)
    assert torch.equal(sg.static(sg.grad(square_sum))(x), 2 * x)


def test_a_static_step_called_inside_another_is_part_of_it():
    inner = sg.static(lambda x: x.sin() * 2)
    outer = sg.static(lambda x: inner(x) + 1)
    x = torch.arange(3.0)
    assert torch.equal(outer(x), x.sin() * 2 + 1)
    assert inner.trace_count == 0 and outer.trace_count == 1


def test_dtensor_inputs_run_as_their_local_shards_and_come_back_as_dtensors(mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    w = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    step = sg.static(lambda params: {"w": params["w"] * 2, "s": params["w"].sum()})
    for _ in range(2):
        out = step({"w": w})
        assert isinstance(out["w"], DTensor) and out["w"].placements == (Shard(0),)
        assert torch.equal(out["w"].full_tensor(), w.full_tensor() * 2)
        assert torch.equal(out["s"].full_tensor(), w.full_tensor().sum())
    assert step.trace_count == 1
    assert "shard of DTensor[Shard(0)] of global shape [4, 2]  <- params['w']" in step.lower({"w": w}).as_text()


# --------------------------------------------------------------------------- threads


def test_threads_making_the_first_call_at_once_trace_once():
    step = sg.static(lambda x: x.sin() * 2)
    others = [sg.static(lambda x, k=k: x * k) for k in range(3)]
    barrier, errors, results = threading.Barrier(7), [], []

    def call(f, k):
        try:
            barrier.wait()
            results.append((f(torch.full((3,), float(k))), k, f))
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(step, k)) for k in range(4)]
    threads += [threading.Thread(target=call, args=(f, k)) for k, f in enumerate(others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert step.trace_count == 1 and all(f.trace_count == 1 for f in others)
    for out, k, f in results:
        assert torch.equal(out, f.fn(torch.full((3,), float(k))))


def test_tracing_does_not_patch_what_other_threads_call():
    original = torch.cuda.synchronize
    inside, release, seen = threading.Event(), threading.Event(), []

    def slow(x):
        inside.set()
        release.wait(5)
        return x + 1

    worker = threading.Thread(target=lambda: sg.static(slow)(torch.ones(1)))
    worker.start()
    inside.wait(5)
    seen.append(torch.cuda.synchronize)
    release.set()
    worker.join()
    assert torch.cuda.synchronize is original and all(f is original for f in seen)


# --------------------------------------------------------------------------- errors


def two(x, y):
    return x + y


@pytest.mark.parametrize(
    "call, text",
    [
        (lambda f: f(torch.ones(1)), "missing a required argument: 'y'"),
        (lambda f: f(torch.ones(1), torch.ones(1), z=1), "got an unexpected keyword argument 'z'"),
    ],
)
def test_a_call_python_would_reject_raises_its_type_error(call, text):
    step = sg.static(two, retrace="error")
    with pytest.raises(TypeError, match=re.escape(text)) as first:
        call(step)
    step(torch.ones(1), torch.ones(1))
    with pytest.raises(TypeError, match=re.escape(text)) as later:
        call(step)
    assert not isinstance(first.value, sg.SgraphError) and not isinstance(later.value, sg.SgraphError)


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda: sg.static(two, donate=2), sg.ArgumentError, "donate position 2 is beyond the 2 positional"),
        (lambda: sg.static(two, donate=1.5), sg.ArgumentTypeError, "donate must be an argument name"),
        (lambda: sg.static(two, donat=0), sg.ArgumentTypeError, "unknown option donat=0; its options are"),
        (lambda: sg.grad(square_sum, argnums=1.0), sg.ArgumentTypeError, "argnums must be an int or a tuple"),
        (lambda: sg.static(two, retrace="never"), sg.ArgumentError, "retrace='never' is not one of"),
    ],
)
def test_option_errors_name_the_option(make, error, text):
    with pytest.raises(error, match=re.escape(text)):
        make()


def test_unknown_option_suggests_the_closest():
    with pytest.raises(TypeError, match=re.escape("Did you mean donate=?")):
        sg.static(donat=0)


def test_an_unhashable_static_leaf_is_named_by_its_path():
    step = sg.static(lambda x, cfg: x)
    with pytest.raises(TypeError, match=re.escape("cfg['opts'] is a set")):
        step(torch.ones(1), {"opts": {1, 2}})


def test_a_retrace_names_the_new_key_in_one_line():
    params = {f"layer{i}.weight": torch.zeros(2) for i in range(200)}
    step = sg.static(lambda p: {k: v + 1 for k, v in p.items()})
    step(params)
    with pytest.warns(sg.RetraceWarning) as record:
        step({**params, "extra": torch.zeros(2)})
    message = str(record[0].message)
    assert "because p['extra'] is new." in message and len(message) < 400


def test_a_retrace_compares_with_the_nearest_cached_signature():
    step = sg.static(lambda x, y: x * y)
    step(torch.ones(8), torch.ones(8))
    with pytest.warns(sg.RetraceWarning):
        step(torch.ones(4), torch.ones(4))
    with pytest.warns(sg.RetraceWarning) as record:
        step(torch.ones(8), torch.ones(8, dtype=torch.float64))  # one leaf away from the first call
    message = str(record[0].message)
    assert "because y: f32[8] -> f64[8]." in message and "x:" not in message


# --------------------------------------------------------------------------- methods and reprs


class Trainer:
    def __init__(self, scale):
        self.scale = scale

    @sg.static(donate="params")
    def step(self, params, x):
        return {"w": params["w"] - self.scale * x}


def test_static_on_a_method_binds_each_instance():
    a, b = Trainer(0.5), Trainer(2.0)
    pa, pb = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    original = pa["w"]
    for _ in range(2):
        pa = a.step(pa, torch.ones(2))
        pb = b.step(pb, torch.ones(2))
    assert torch.equal(pa["w"], torch.zeros(2)) and torch.equal(pb["w"], torch.full((2,), -3.0))
    assert pa["w"] is original  # donated by name, as for a function
    assert a.step.trace_count == 1 and b.step.trace_count == 1
    assert isinstance(Trainer.step, sg.Transformed)


def test_a_module_method_is_guarded_on_its_training_flag():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        @sg.static(retrace="allow")
        def run(self, x):
            return self.drop(x)

    net, x = Net(), torch.ones(100)
    assert not torch.equal(net.run(x), x)
    net.eval()
    assert torch.equal(net.run(x), x)


def test_reprs_show_options_and_round_numbers():
    step = sg.static(two, donate="x", retrace="allow")
    assert repr(step) == "<sg.static(two) donate=('x',) retrace='allow': 0 compiled signatures, 0 traces>"
    step(torch.ones(1), torch.ones(1))
    stats = repr(step.last_compiled.stats)
    assert re.search(r"trace_seconds=\d\.\d+(e-\d+)?[,)]", stats) and len(stats) < 200


def test_a_fallen_back_step_says_so():
    @sg.static(fallback="eager")
    def step(x):
        return x * 2 if x.sum() > 0 else x

    with pytest.warns(sg.FallbackWarning):
        step(torch.ones(2))
    assert "fell back to eager" in repr(step)
    with pytest.raises(sg.CaptureError, match="runs eagerly since it could not be captured"):
        step.last_compiled  # noqa: B018


# --------------------------------------------------------------------------- checkpointed randomness


def test_checkpointed_dropout_raises_instead_of_wrong_gradients():
    from torch.utils.checkpoint import checkpoint

    def loss(w, x):
        h = checkpoint(lambda a: torch.nn.functional.dropout(a * w, 0.5, training=True), x, use_reentrant=False)
        return (h * h).sum()

    with pytest.raises(sg.CaptureError, match="runs again in the backward.*torch.utils.checkpoint"):
        sg.static(lambda w, x: sg.grad(loss)(w, x))(torch.ones(8), torch.arange(8.0))


def test_checkpoint_inside_a_functional_module_raises_naming_the_recomputation():
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(lambda t: torch.tanh(self.fc(t)), x, use_reentrant=False)

    apply, params, buffers = sg.functional(Net())
    loss = lambda p, x: apply(p, buffers, x).square().sum()  # noqa: E731
    with pytest.raises(sg.CaptureError, match=r"in the backward: torch.utils.checkpoint recomputes .*sg.plan_memory"):
        sg.static(sg.grad(loss))(params, torch.randn(3, 4))


def test_checkpointed_sg_random_dropout_matches_eager():
    from torch.utils.checkpoint import checkpoint

    def loss(w, x, key):
        h = checkpoint(lambda a: sg.random.dropout(key, a * w, 0.5), x, use_reentrant=False)
        return (h * h).sum()

    args = (torch.ones(8), torch.arange(8.0), sg.random.key(0))
    assert torch.equal(sg.static(lambda w, x, k: sg.grad(loss)(w, x, k))(*args), sg.grad(loss)(*args))


# --------------------------------------------------------------------------- clean failures


def _process_state():
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from sgraph._src import guards

    return (
        guards.is_tracing(),
        len(_get_current_function_mode_stack()),
        len(_get_current_dispatch_mode_stack()),
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        torch.cuda.synchronize,
        torch.manual_seed,
        torch.get_rng_state().clone(),
    )


@pytest.mark.parametrize(
    "step",
    [
        lambda x: x.item() + x,  # a capture error while tracing
        lambda x: x.view(7),  # torch's own error while tracing
        lambda x: torch.manual_seed(3) and x,  # an RNG change, undone
        lambda x: Box(x),  # an escaping tensor, found after tracing
    ],
)
def test_a_failed_trace_leaves_the_process_as_it_was(step):
    before = _process_state()
    with pytest.raises((sg.SgraphError, RuntimeError)):
        sg.static(step)(torch.ones(6))
    after = _process_state()
    assert after[:-1] == before[:-1] and torch.equal(after[-1], before[-1])


def test_only_ops_that_draw_random_numbers_count_as_recomputed_randomness():
    from sgraph._src.capture import draws_random_numbers

    aten = torch.ops.aten
    q = torch.ones(1, 1, 2, 4)
    assert draws_random_numbers(aten.native_dropout.default, (q, 0.5, True), {})
    assert not draws_random_numbers(aten.native_dropout.default, (q, 0.0, True), {})
    assert not draws_random_numbers(aten.native_dropout.default, (q, 0.5, False), {})
    assert not draws_random_numbers(aten._scaled_dot_product_flash_attention.default, (q, q, q), {})
    assert draws_random_numbers(aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.1), {})
    backward = aten._scaled_dot_product_cudnn_attention_backward.default
    assert torch.Tag.nondeterministic_seeded in backward.tags and not draws_random_numbers(backward, (), {})


def test_checkpointed_attention_without_dropout_matches_eager():
    from torch.utils.checkpoint import checkpoint

    def loss(w, x):
        def block(a):
            q = (a * w).reshape(1, 2, 3, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

        return checkpoint(block, x, use_reentrant=False).square().sum()

    args = (torch.linspace(-1, 1, 24), torch.linspace(0, 2, 24))
    torch.testing.assert_close(sg.static(sg.grad(loss))(*args), sg.grad(loss)(*args), rtol=1e-6, atol=0)


def test_an_in_place_write_into_an_expanded_view_raises():
    def step(w):
        w.expand(2, *w.shape).zero_()  # eager writes each element once; a functional graph would sum
        return w + 1

    with pytest.raises(sg.CaptureError, match="writes in place into an expanded view"):
        sg.static(step, donate=0)(torch.randn(3))
    assert torch.equal(sg.static(lambda x: x.expand(2, 3) * 2)(torch.ones(3)), torch.full((2, 3), 2.0))


@pytest.mark.parametrize(
    "write",
    [
        lambda w, x: w.expand(2, *w.shape)[0].copy_(x),
        lambda w, x: w.unsqueeze(0).expand(3, *w.shape)[1:2].fill_(x[0]),
        lambda w, x: w[None].expand(2, -1)[0].mul_(x),
    ],
    ids=["select-copy", "slice-fill", "unsqueezed-mul"],
)
def test_an_in_place_write_into_a_view_of_an_expanded_view_raises(write):
    """The written view's elements are distinct, but its write goes back through the expand
    as ``w + sum(new - w)``: 1 is lost beside 1e8 in fp32, and an infinite ``w`` gives NaN."""

    def step(w, x):
        write(w, x)
        return w + x

    w, x = torch.tensor([1e8, float("-inf"), 2.0]), torch.tensor([1.0, float("inf"), 3.0])
    for transform in (sg.static, lambda f, **kw: sg.static(sg.fuse(f), **kw)):
        with pytest.raises(sg.CaptureError, match=r"writes in place into a view of an expanded view .* at "):
            transform(step, donate=0)(w.clone(), x)


def test_outputs_are_plain_tensors_with_eager_values_even_where_eager_returns_parameters():
    def step(p, x):
        with torch.no_grad():
            moved = (p["w"] - 0.1 * x).requires_grad_()
        return {"w": moved, "param": nn.Parameter(p["w"] * 2)}

    eager = step({"w": torch.ones(3)}, torch.arange(3.0))
    static = sg.static(step, donate="p")
    for _ in range(2):
        params = {"w": torch.ones(3)}
        out = static(params, torch.arange(3.0))
        for key in ("w", "param"):
            assert type(out[key]) is torch.Tensor and not out[key].requires_grad
            torch.testing.assert_close(out[key], eager[key].detach(), rtol=0, atol=0)
        again = static({"w": out["w"]}, torch.arange(3.0))["w"]  # fed back as it is
        assert again.tolist() == pytest.approx([1.0, 0.8, 0.6])


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda d, items: d.__setitem__("new", d["a"] * 2), "adds d['new']"),
        (lambda d, items: items.append(d["a"]), "adds items[0]"),
        (lambda d, items: d.__setitem__("a", d["a"] + 1), "replaces d['a']"),
        (lambda d, items: d.pop("a"), "removes d['a']"),
    ],
)
def test_a_step_changing_its_argument_containers_raises_naming_the_change(change, named):
    def step(d, items):
        out = d["a"] + 1
        change(d, items)
        return out

    d, items = {"a": torch.ones(2)}, []
    with pytest.raises(sg.CaptureError, match=re.escape(named)):
        sg.static(step)(d, items)
    assert list(d) == ["a"] and items == [] and torch.equal(d["a"], torch.ones(2))  # the user's own are untouched


def test_warnings_point_at_the_users_call():
    import warnings

    step = sg.static(lambda p, e: p * 2, donate=("p", "e"), retrace="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        step(torch.ones(3), torch.ones(2, dtype=torch.long))  # e is donated but matches no output
        step(torch.ones(4), torch.ones(2, dtype=torch.long))  # a retrace
    assert {w.category for w in caught} >= {sg.DonationWarning, sg.RetraceWarning}
    for w in caught:
        if issubclass(w.category, sg.SgraphWarning):
            assert (w.filename, w.lineno) in ((__file__, line), (__file__, line + 1)), w
