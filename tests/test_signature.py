"""Signatures: the cache key of a compiled step, and the text of what changed."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import sgraph as sg
from sgraph._src.signature import signature_of


def sig(tree):
    leaves, spec = sg.tree.flatten(tree)
    return signature_of(leaves, spec)


def test_same_metadata_same_signature_and_values_do_not_matter():
    assert sig({"w": torch.zeros(2, 3)}) == sig({"w": torch.ones(2, 3)})
    assert hash(sig({"w": torch.zeros(2, 3)})) == hash(sig({"w": torch.ones(2, 3)}))


@pytest.mark.parametrize(
    "other, text",
    [
        (torch.zeros(3, 2), "x: f32[2, 3] -> f32[3, 2]"),
        (torch.zeros(2, 3, dtype=torch.float64), "x: f32[2, 3] -> f64[2, 3]"),
        (torch.zeros(3, 2).t(), "x: f32[2, 3] with strides (3, 1) -> f32[2, 3] with strides (1, 2)"),
        (2.0, "x: f32[2, 3] -> static 2.0 (float)"),
    ],
)
def test_difference_names_the_leaf_and_old_and_new(other, text):
    old, new = sig((torch.zeros(2, 3),)), sig((other,))
    assert old != new
    assert new.difference(old, ["x"]) == text


def test_structure_change_is_described():
    old, new = sig({"a": torch.zeros(1)}), sig({"b": torch.zeros(1)})
    assert new.difference(old, ["b"]).startswith("the argument structure changed")


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()


def test_dtensor_placements_are_part_of_the_signature(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sharded = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    replicated = distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()])
    assert sig((sharded,)) == sig((distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]),))
    assert sig((sharded,)) != sig((replicated,))
    assert "placements [Replicate()]" in sig((replicated,)).difference(sig((sharded,)), ["p"])
