import os

import torch

if not torch.cuda.is_available():
    # Own Triton kernels run in Triton's interpreter on CPU tensors; the switch must be
    # set before anything imports Triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo mesh on the CPU (the process group is made here if none exists)."""
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (dist.get_world_size(),))
    if owned:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
