"""Train a tiny MLP with one captured train step: forward, backward and AdamW in one graph.

Runs on CPU in seconds; on a GPU the same step replays as one CUDA graph.
    python examples/quickstart.py
"""

import torch
import torch.nn.functional as F
from models import mlp

import sgraph as sg

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = mlp(width=64, depth=2, classes=4).to(device)
apply, params, buffers = sg.functional(model)

opt = sg.optim.chain(
    sg.optim.clip_by_global_norm(1.0),
    sg.optim.adamw(sg.optim.warmup_cosine(1e-2, warmup_steps=20, total_steps=300)),
)
opt_state = opt.init(params)


def loss_fn(params, batch):
    x, y = batch
    return F.cross_entropy(apply(params, buffers, x), y)


@sg.static(donate=("params", "opt_state"))
def train_step(params, opt_state, batch):
    loss, grads = sg.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return sg.optim.apply_updates(params, updates), opt_state, {"loss": loss}


# A synthetic task: the label is the argmax of a fixed random projection of x.
teacher = torch.randn(64, 4, device=device)
for step in range(300):
    x = torch.randn(128, 64, device=device)
    params, opt_state, metrics = train_step(params, opt_state, (x, (x @ teacher).argmax(1)))
    if step % 50 == 0 or step == 299:
        print(f"step {step:3d}  loss {metrics['loss'].item():.4f}")

print(f"traced {train_step.trace_count} time(s); runtime: {train_step.last_compiled.stats.runtime}")
