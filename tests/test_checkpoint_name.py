"""sg.checkpoint_name: user tags on values of a step, pinned by sg.plan_memory's save= and recompute=."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models_for_tests import classification_batches, run_steps, train_step_fn
from torch.fx.experimental.proxy_tensor import make_fx

import sgraph as sg
from sgraph._src.passes.memory.remat import RECOMPUTED_KEY
from sgraph._src.source import MODULE_KEY
from sgraph._src.tags import TAGS_KEY

W1, W2, X = torch.randn(16, 32), torch.randn(32, 4), torch.randn(8, 16)


def grads_step(tag_view=False):
    """Gradients of a two-layer net: gelu's backward reads the matmul output ``proj``, the
    second matmul's reads gelu's output ``act`` (by default only ``act`` is recomputed).
    ``tag_view``: a view of ``proj`` is tagged, which the backward does not read."""

    def step(w1, w2, x):
        def loss(ws):
            h = sg.checkpoint_name(x @ ws[0], "proj")
            a = sg.checkpoint_name(F.gelu(h), "act")
            if tag_view:
                return (a @ ws[1]).sum() + sg.checkpoint_name(h.view(-1), "proj_flat").sum()
            return (a @ ws[1]).sum()

        return sg.grad(loss)((w1, w2))

    return step


def _tags(program):
    return {n.name: n.meta[TAGS_KEY] for n in program.graph.nodes if TAGS_KEY in n.meta}


def _plan(step, **options):
    return sg.static(sg.plan_memory(**options)(step)).lower(W1, W2, X).memory_plan


def test_outside_a_trace_it_returns_x_itself():
    t = torch.randn(3)
    tree = {"a": t, "b": [t, None]}
    assert sg.checkpoint_name(t, "a") is t
    assert sg.checkpoint_name(tree, name="b") is tree
    # Under a trace that is not sgraph's, too: nothing is recorded.
    gm = make_fx(lambda x: sg.checkpoint_name(x * 2, "doubled"))(t)
    assert not any(TAGS_KEY in n.meta for n in gm.graph.nodes)


def test_tags_go_on_the_node_that_made_the_value_and_add_no_op():
    def plain(w1, w2, x):
        return sg.grad(lambda ws: (F.gelu(x @ ws[0]) @ ws[1]).sum())((w1, w2))

    tagged = sg.static(grads_step()).trace(W1, W2, X).program  # as traced, before any pass
    assert _tags(tagged) == {"mm": ("proj",), "gelu": ("act",)}
    assert [n.target for n in tagged.ops()] == [n.target for n in sg.static(plain).trace(W1, W2, X).program.ops()]
    assert _tags(sg.static(grads_step()).lower(W1, W2, X).program) == _tags(tagged)  # and after them


def test_a_pytree_tags_each_leaf_once_per_name():
    def step(x):
        pair = sg.checkpoint_name({"s": torch.sin(x), "c": torch.cos(x)}, "trig")
        sg.checkpoint_name(pair["s"], "trig")  # the same name again: recorded once
        sg.checkpoint_name(pair["s"], "sine")
        return pair["s"] + pair["c"]

    assert _tags(sg.static(step).lower(X).program) == {"sin": ("trig", "sine"), "cos": ("trig",)}


def test_a_tagged_matmul_pinned_for_recompute_is_recomputed_with_bitwise_equal_gradients():
    step = grads_step()
    assert _plan(step).recomputed == ("gelu",)  # the policy keeps matmul outputs
    planned = sg.static(sg.plan_memory(recompute="proj")(step))
    lowered = planned.lower(W1, W2, X)
    assert "mm" in lowered.memory_plan.recomputed
    assert "mm" in {n.meta[RECOMPUTED_KEY] for n in lowered.program.graph.nodes if RECOMPUTED_KEY in n.meta}
    got, want, eager = planned(W1, W2, X), sg.static(step)(W1, W2, X), step(W1, W2, X)
    for g, w, e in zip(got, want, eager):
        assert torch.equal(g, w) and torch.equal(g, e)


def test_save_with_a_tag_keeps_a_value_the_policy_recomputes():
    step = grads_step()
    assert _plan(step).recomputed == ("gelu",)
    assert _plan(step, save="act").recomputed == ()
    assert _plan(step, save="a*").recomputed == ()  # patterns as for module paths
    assert _plan(step, recompute="proj", save="proj").recomputed == ("gelu",)  # save wins


def test_a_tag_on_a_view_pins_the_buffer_it_shows():
    step = grads_step(tag_view=True)
    assert _tags(sg.static(step).lower(W1, W2, X).program)["view"] == ("proj_flat",)
    assert "mm" in _plan(step, recompute="proj_flat").recomputed
    assert "mm" not in _plan(step, policy="save_block_inputs", save="proj_flat").recomputed


class _Tagged(nn.Module):
    """A block that tags its activation and writes in place (so the step is functionalized)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc(x)
        h = sg.checkpoint_name(h * torch.sigmoid(h), "swish")
        out = self.head(h)
        return out.add_(1.0)


def test_tags_and_module_paths_survive_a_functionalized_step_and_train_bitwise():
    torch.manual_seed(0)
    apply, params, _ = sg.functional(_Tagged())
    opt = sg.optim.adamw(1e-2)
    step = train_step_fn(apply, F.cross_entropy, opt)
    batches = classification_batches(3, 8, 16, 4)
    program = sg.static(step).lower(params, opt.init(params), batches[0]).program
    assert not any(str(n.target).startswith("aten.add_") for n in program.ops())  # made functional
    assert list(_tags(program).values()) == [("swish",)]
    assert {"fc", "head"} <= {n.meta.get(MODULE_KEY) for n in program.graph.nodes}
    planned = sg.static(sg.plan_memory(recompute="swish")(step))
    got = run_steps(planned, params, opt.init(params), batches)
    want = run_steps(sg.static(step), params, opt.init(params), batches)
    for (loss_g, p_g), (loss_w, p_w) in zip(got, want):
        assert torch.equal(loss_g, loss_w) and all(torch.equal(p_g[k], p_w[k]) for k in p_w)
    swish = next(name for name, tags in _tags(program).items() if tags == ("swish",))
    assert swish in planned.last_compiled.lowered.memory_plan.recomputed
    unpinned = sg.static(sg.plan_memory(step)).lower(params, opt.init(params), batches[0]).memory_plan
    assert swish not in unpinned.recomputed  # kept, unless pinned


@pytest.mark.parametrize(
    ("x", "name", "match"),
    [
        (X, 3, r"sg.checkpoint_name: name must be a non-empty string, such as 'attn_scores'; found 3"),
        (X, "", r"name must be a non-empty string.*found ''"),
        (3, "a", r"x must be a tensor or a pytree of tensors; found 3 \(type int\) at x\. Name the tensors only"),
        ({"w": X, "lr": 0.1}, "a", r"found 0\.1 \(type float\) at x\['lr'\]"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(x, name, match):
    with pytest.raises(sg.ArgumentTypeError, match=match):
        sg.checkpoint_name(x, name)


def test_a_pattern_naming_nothing_warns_with_the_closest_name():
    step = grads_step()
    with pytest.warns(
        sg.SgraphWarning, match=r"recompute='prjo' matches no module path and no tag .* Did you mean 'proj'"
    ):
        _plan(step, recompute="prjo")
    with pytest.warns(sg.SgraphWarning, match=r"save='blocks\.\*' matches no module path and no tag"):
        _plan(step, save="blocks.*")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(step, recompute="proj", save=("act", "pr*"))  # each names something: no warning
