"""sg.shard on one GPU: a mesh of size 1 (one NCCL process) under sg.static, with and
without sg.fuse, gives the unsharded step's results, with no collective left in the
captured graph."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models_for_tests import gpt_loss, run_steps, tiny_gpt, token_batches, train_step_fn

import sgraph as sg
from sgraph._src.passes.shard.collectives import collectives

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), device_id=torch.device("cuda", 0))
    try:
        yield sg.mesh(dp=1)
    finally:
        dist.destroy_process_group()


def _setup():
    model = tiny_gpt().cuda()
    apply, params, _ = sg.functional(model)
    # SGD, not AdamW: the attention's key bias has a gradient of pure rounding noise
    # (softmax ignores it), which AdamW's division by the gradient's own scale turns
    # into updates of lr whatever the noise, so any other kernel choice shows there.
    opt = sg.optim.sgd(1e-2, momentum=0.9)
    batches = [(x.cuda(), y.cuda()) for x, y in token_batches(3, 64)]
    return train_step_fn(apply, gpt_loss, opt), params, opt, batches


@pytest.mark.parametrize("fuse", [False, True], ids=["eager-kernels", "fused"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_mesh_of_one_gpu_matches_the_unsharded_step(mesh, fuse, strategy):
    step, params, opt, batches = _setup()
    body = sg.fuse(step) if fuse else step
    want = run_steps(sg.static(body, donate=("params", "opt_state")), params, opt.init(params), batches)
    spec = sg.ddp("dp") if strategy == "ddp" else sg.fsdp("dp")
    sharded = sg.static(sg.shard(mesh, params=spec, batch=sg.P("dp"))(body), donate=("params", "opt_state"))
    placed = sg.distribute(params, mesh, spec)
    got = run_steps(sharded, placed, opt.init(placed), batches)
    compiled = sharded.last_compiled
    assert compiled.stats.runtime in ("cudagraph", "inductor+cudagraph"), compiled.stats
    assert collectives(compiled.program.graph) == [], "a 1-rank mesh needs no communication"
    # DTensor may pick other kernels (attention's among them) and runs the update
    # tensor by tensor, so params, and the losses after the first update, agree to
    # rounding; with fusion Inductor also sees DTensor's views.
    first = got[0][0].full_tensor()
    assert torch.equal(first, want[0][0]) if not fuse else torch.allclose(first, want[0][0], rtol=1e-5)
    for (lg, pg), (lw, pw) in zip(got, want):
        torch.testing.assert_close(lg.full_tensor(), lw, rtol=1e-5, atol=1e-6)
        for k in pw:
            torch.testing.assert_close(pg[k].full_tensor(), pw[k], rtol=1e-5, atol=1e-6)
