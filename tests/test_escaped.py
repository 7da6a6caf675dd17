"""A tensor the step computes and stores outside its outputs is refused: the trace
leaves a placeholder there (no values), where eager stores a new tensor on every call."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import sgraph as sg

HISTORY: list[torch.Tensor] = []
EMA = torch.zeros(3)


def logs_into_a_global_list(x):
    loss = x.square().sum()
    HISTORY.append(loss)
    return loss


def rebinds_a_global(x):
    global EMA
    EMA = 0.9 * EMA + 0.1 * x
    return x * 2


def _record(cache, x):
    cache["last"] = x * 2  # a helper of this file, called by the step


def closes_over_a_dict():
    cache = {"last": torch.zeros(3)}

    def step(x):
        _record(cache, x)
        return x.sum()

    return step


class Remembers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self._last_hidden = None

    def forward(self, x):
        h = self.lin(x)
        self._last_hidden = h  # kept for a plot, eager style
        return h


def a_module_attribute():
    apply, params, buffers = sg.functional(Remembers())
    return lambda x: apply(params, buffers, x).sum()


@pytest.mark.parametrize(
    "make, place",
    [
        (lambda: logs_into_a_global_list, "global HISTORY[0]"),
        (lambda: rebinds_a_global, "global EMA"),
        (closes_over_a_dict, "cache['last']"),
        (a_module_attribute, "Remembers._last_hidden"),
    ],
    ids=["global list", "global rebound", "closed-over dict via a helper", "module attribute"],
)
def test_a_tensor_stored_outside_the_outputs_raises_naming_where(make, place):
    step = make()
    text = f"stores a tensor it computes outside its outputs, in {place}"
    with pytest.raises(sg.CaptureError, match=re.escape(text)):
        sg.static(step)(torch.ones(3))
    HISTORY.clear()


def test_no_false_alarm_for_nested_steps_torch_caches_and_weight_norm():
    inner = sg.static(lambda x: x * 2)  # its compiled graphs hold its own trace's placeholders
    torch.manual_seed(0)
    lstm_apply, lstm_params, _ = sg.functional(nn.LSTM(3, 3, batch_first=True))  # caches _flat_weights
    norm_apply, norm_params, _ = sg.functional(nn.utils.weight_norm(nn.Linear(3, 3)))  # sets .weight

    def loss(params, x):
        h = lstm_apply(params["lstm"], {}, inner(x))[0]
        return norm_apply(params["norm"], {}, h).square().mean()

    def step(params, x):
        return sg.value_and_grad(loss)(params, x)

    params, x = {"lstm": lstm_params, "norm": norm_params}, torch.randn(2, 4, 3)
    got, want = sg.static(step)(params, x), step(params, x)
    torch.testing.assert_close(got, want)
