"""sg.tree: optree in sgraph's namespace; errors name the path."""

from __future__ import annotations

import re
from typing import NamedTuple

import pytest
import torch

import sgraph as sg


class State(NamedTuple):
    count: torch.Tensor
    mu: dict


def test_tensors_are_leaves_and_paths_read_like_python():
    tree = {"b": State(torch.zeros(()), {"w": torch.ones(2)}), "a": [torch.ones(1), None]}
    paths, leaves, _ = sg.tree.flatten_with_paths(tree, prefix="opt_state")
    assert paths == ["opt_state['a'][0]", "opt_state['b'].count", "opt_state['b'].mu['w']"]
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def test_flatten_unflatten_round_trip():
    tree = {"x": (torch.ones(2), 3), "y": State(torch.zeros(1), {})}
    leaves, spec = sg.tree.flatten(tree)
    again = sg.tree.unflatten(spec, leaves)
    assert again["x"][1] == 3 and again["y"].count is tree["y"].count


def test_map_over_several_trees():
    out = sg.tree.map(lambda a, b: a + b, {"w": torch.ones(2)}, {"w": torch.ones(2)})
    assert torch.equal(out["w"], torch.full((2,), 2.0))


@pytest.mark.parametrize(
    "found, where, expected, got",
    [
        ({"a": {"d": 1}}, "['a']", "dict with keys ['c']", "dict with keys ['d']"),
        ({"a": {"c": [1]}}, "['a']['c']", "a leaf of type int", "list of length 1"),
        ({"a": {"c": 1}, "e": 2}, "<root>", "dict with keys ['a']", "dict with keys ['a', 'e']"),
    ],
)
def test_structure_errors_name_the_path_expected_and_found(found, where, expected, got):
    message = f"check: structure differs at {where}: expected {expected}, found {got}"
    with pytest.raises(sg.TreeStructureError, match=re.escape(message)):
        sg.tree.assert_same_structure({"a": {"c": 1}}, found, what="check")


def test_map_structure_error_is_a_value_error():
    with pytest.raises(ValueError, match=re.escape("tree.map argument 1: structure differs at ['w']")):
        sg.tree.map(lambda a, b: a, {"w": [1, 2]}, {"w": [1]})


def test_registered_nodes_flatten():
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

    sg.tree.register_node(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))
    assert sg.tree.leaves(Pair(torch.ones(1), 2)) == [torch.ones(1), 2]


def test_paths_of_a_tree_itself_and_of_its_spec_agree():
    state = sg.optim.adamw(1e-3).init({"w": torch.ones(2), "b": torch.zeros(1)})
    want = ["opt_state.count", "opt_state.mu['b']", "opt_state.mu['w']", "opt_state.nu['b']", "opt_state.nu['w']"]
    assert sg.tree.paths(state, prefix="opt_state") == want
    assert sg.tree.paths(sg.tree.flatten(state)[1], prefix="opt_state") == want


def test_structure_messages_name_the_mapping_type_and_an_ordered_dicts_order():
    import collections

    cases = [
        (collections.OrderedDict(a=1, b=2), collections.OrderedDict(b=2, a=1), "OrderedDict with keys ['b', 'a']"),
        ({"a": 1}, collections.OrderedDict(a=1), "expected dict with keys ['a'], found OrderedDict"),
        ({"a": 1}, collections.defaultdict(int, a=1), "found defaultdict with keys ['a']"),
    ]
    for a, b, named in cases:
        with pytest.raises(sg.TreeStructureError, match=re.escape(named)):
            sg.tree.map(lambda u, v: u + v, a, b)
