"""sg.grad / sg.value_and_grad against torch.autograd."""

from __future__ import annotations

import pytest
import torch

import sgraph as sg


def loss(params, x):
    return (torch.sin(x @ params["w"]) + params["b"]).pow(2).sum()


def setup():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}, torch.randn(4, 3, generator=g)


def reference(params, x):
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    value = loss(leaves, x)
    value.backward()
    return value.detach(), {k: v.grad for k, v in leaves.items()}


def test_value_and_grad_matches_backward_and_leaves_inputs_alone():
    params, x = setup()
    value, grads = sg.value_and_grad(loss)(params, x)
    ref_value, ref_grads = reference(params, x)
    assert torch.equal(value, ref_value) and not value.requires_grad
    for k in params:
        assert torch.equal(grads[k], ref_grads[k])
        assert not params[k].requires_grad


def test_argnums_tuple_and_has_aux():
    params, x = setup()

    def f(params, x):
        return loss(params, x), {"n": x.shape[0]}

    (value, aux), (g_params, g_x) = sg.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
    xr = x.clone().requires_grad_(True)
    loss(params, xr).backward()
    assert aux == {"n": 4} and torch.equal(g_x, xr.grad)
    assert set(g_params) == {"w", "b"}


def test_grad_returns_zeros_for_unused_leaves():
    grads = sg.grad(lambda p: p["a"].sum())({"a": torch.ones(2), "unused": torch.ones(3)})
    assert torch.equal(grads["unused"], torch.zeros(3))


def test_nested_grad_gives_second_derivative():
    second = sg.grad(sg.grad(lambda x: (x**3).sum()))(torch.tensor([2.0]))
    assert torch.equal(second, torch.tensor([12.0]))


def test_errors_name_the_problem():
    with pytest.raises(
        TypeError, match=r"must return a floating-point scalar tensor; found a float32 tensor of shape \(2,\)"
    ):
        sg.grad(lambda x: x * 2)(torch.ones(2))
    with pytest.raises(TypeError, match=r"Pass has_aux=True"):
        sg.grad(lambda x: (x.sum(), 1))(torch.ones(2))
    with pytest.raises(TypeError, match=r"args\[0\]\['i'\] has dtype int64; gradients need floating-point"):
        sg.grad(lambda p: p["f"].sum())({"f": torch.ones(1), "i": torch.ones(1, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"argnums must be a non-negative int"):
        sg.grad(loss, argnums=-1)
    with pytest.raises(TypeError, match=r"argnums=\(2,\) but only 2 positional arguments"):
        sg.grad(loss, argnums=2)(*setup())
    with pytest.raises(ValueError, match=r"argnums must not repeat a position; found \(0, 0\)"):
        sg.grad(loss, argnums=(0, 0))
    with pytest.raises(TypeError, match=r"has_aux must be True or False; found 1"):
        sg.grad(loss, has_aux=1)


@pytest.mark.parametrize("static", [False, True])
def test_gradients_under_inference_mode_as_torch_func(static):
    params, x = setup()
    expected = reference(params, x)[1]
    with torch.inference_mode():
        made_inside = {k: v.clone() for k, v in params.items()}, x.clone()  # inference tensors
    for args in ((params, x), made_inside):
        grad = sg.static(sg.grad(loss)) if static else sg.grad(loss)
        with torch.inference_mode():
            grads = grad(*args)
        for k in params:
            torch.testing.assert_close(grads[k], expected[k])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a CUDA device")
def test_a_step_differentiating_fake_cuda_tensors_without_a_gpu_raises_instead_of_aborting():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def step(w, x):
        loss, g = sg.value_and_grad(lambda w: (x @ w).sum())(w)
        return w - 0.1 * g, loss

    with FakeTensorMode():  # how a step for a GPU is traced and analysed without one
        w, x = torch.empty(8, 4, device="cuda"), torch.empty(2, 8, device="cuda")
        cpu_w, cpu_x = torch.empty(8, 4), torch.empty(2, 8)
    with pytest.raises(
        sg.CaptureError, match=r"sg.grad\(.*<lambda>\): differentiates tensors on cuda:0.*FakeTensorMode"
    ):
        sg.static(step).lower(w, x)
    lowered = sg.static(step).lower(cpu_w, cpu_x)  # the fix the message gives
    assert lowered.memory_analysis().peak_bytes > 0
