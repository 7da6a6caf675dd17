"""Signatures: the cache key of a compiled step, and the text of what changed."""

from __future__ import annotations

import pytest
import torch

import sgraph as sg
from sgraph._src.argtree import ArgFlattener
from sgraph._src.signature import signature_of, static_key


def sig(args, names=None):
    leaves, structure = ArgFlattener().flatten(args, {})
    names = names or [f"a{i}" for i in range(len(args))]
    paths = [p for name, a in zip(names, args) for p in sg.tree.flatten_with_paths(a, prefix=name)[0]]
    return signature_of(leaves, structure, paths, names=names)


def test_same_metadata_same_signature_and_values_do_not_matter():
    assert sig(({"w": torch.zeros(2, 3)},)) == sig(({"w": torch.ones(2, 3)},))
    assert hash(sig(({"w": torch.zeros(2, 3)},))) == hash(sig(({"w": torch.ones(2, 3)},)))


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
    old, new = sig((torch.zeros(2, 3),), ["x"]), sig((other,), ["x"])
    assert old != new
    assert new.difference(old) == text


def test_a_new_key_among_200_is_named_in_one_short_line():
    params = {f"layer{i}.weight": torch.zeros(2) for i in range(200)}
    old = sig((params,), ["params"])
    new = sig(({**params, "extra": torch.zeros(2)},), ["params"])
    assert new.difference(old) == "params['extra'] is new"
    assert old.difference(new) == "params['extra'] is missing"


def test_dict_key_order_is_part_of_the_signature_and_named():
    old = sig(({"w": torch.zeros(1), "b": torch.zeros(1)},), ["p"])
    new = sig(({"b": torch.zeros(1), "w": torch.zeros(1)},), ["p"])
    assert old != new
    assert new.difference(old) == "the key order of p changed: ['w', 'b'] -> ['b', 'w']"


def test_static_floats_compare_by_bits_and_nan_equals_nan():
    assert static_key(0.0) != static_key(-0.0)
    assert static_key(float("nan")) == static_key(float("nan"))
    assert static_key(0.5) != static_key(0.0) and static_key(1) != static_key(1.0) != static_key(True)
    assert sig((torch.zeros(1), -0.0), ["x", "s"]).difference(sig((torch.zeros(1), 0.0), ["x", "s"])) == (
        "s: static 0.0 (float) -> static -0.0 (float)"
    )


def test_dtensor_placements_are_part_of_the_signature(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sharded = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    replicated = distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()])
    assert sig((sharded,)) == sig((distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]),))
    assert sig((sharded,)) != sig((replicated,))
    assert "placements [Replicate()]" in sig((replicated,), ["p"]).difference(sig((sharded,), ["p"]))
