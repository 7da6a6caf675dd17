"""examples/shard_mlp.py launched the standard ways: one process, and torchrun with
2 processes. The step is the same; the losses agree (fp32, printed to 6 digits: the
sums over ranks add in another order)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from gloo_workers import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _losses(command: list[str]) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    done = subprocess.run(command, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]


def test_the_same_step_on_one_and_two_processes_gives_the_same_losses():
    one = _losses([sys.executable, "shard_mlp.py"])
    port = f"--master_port={free_port()}"
    two = _losses([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", port, "shard_mlp.py"])
    assert len(one) == len(two) == 4
    assert one[-1] < 0.6 * one[0]  # it trains
    for a, b in zip(one, two):
        assert abs(a - b) <= 2e-6 + 1e-5 * abs(a), (one, two)
