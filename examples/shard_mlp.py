"""One train step, any number of processes: FSDP over a "dp" mesh axis.

The step is written for whole tensors; only the mesh changes with the world size.
Each rank feeds its own rows of the global batch. Run it on CPU as:
    python examples/shard_mlp.py                                # one process
    torchrun --nproc_per_node 2 examples/shard_mlp.py           # two (or 4, ...)
The losses printed are the same, up to float rounding, whatever the number of processes.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import mlp

import sgraph as sg

GLOBAL_BATCH, STEPS = 64, 30

if "RANK" not in os.environ:  # started without torchrun: a group of one process
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if torch.cuda.is_available():
    torch.cuda.set_device(rank % torch.cuda.device_count())
mesh = sg.mesh(dp=world)

torch.manual_seed(0)  # the same initial model on every rank
model = mlp(width=64, depth=2, classes=4)
apply, params, buffers = sg.functional(model.to(mesh.device_type))
params = sg.distribute(params, mesh, sg.fsdp("dp"))  # each rank keeps its shard
opt = sg.optim.adamw(1e-2)
opt_state = opt.init(params)


def loss_fn(params, batch):
    x, y = batch
    return F.cross_entropy(apply(params, buffers, x), y)


@sg.static(donate=("params", "opt_state"))
@sg.shard(mesh, params=sg.fsdp("dp"), batch=sg.P("dp"))
def train_step(params, opt_state, batch):
    loss, grads = sg.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return sg.optim.apply_updates(params, updates), opt_state, {"loss": loss}


generator = torch.Generator().manual_seed(1)  # the same global batches on every rank
teacher = torch.randn(64, 4, generator=generator)
rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
for step in range(STEPS):
    x = torch.randn(GLOBAL_BATCH, 64, generator=generator)
    batch = (x[rows].to(mesh.device_type), (x @ teacher).argmax(1)[rows].to(mesh.device_type))
    params, opt_state, metrics = train_step(params, opt_state, batch)
    if rank == 0 and (step % 10 == 0 or step == STEPS - 1):
        print(f"step {step:3d}  loss {metrics['loss'].full_tensor().item():.6f}")

if rank == 0:
    lowered = train_step.lower(params, opt_state, batch)
    print(lowered.cost_analysis().as_text().splitlines()[0])
dist.destroy_process_group()
