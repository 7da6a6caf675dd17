"""Tests of sg.random: known answers, key derivation, statistics, tracing, errors.

Statistical bounds are 6 standard errors (or a p = 1e-6 critical value) of the
statistic under the null hypothesis, with fixed seeds: a correct generator fails
with probability about 1e-8 per check, a biased one fails reliably.
"""

import math
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import sgraph as sg
from sgraph._src.random.samplers import box_muller, unit24, unit53
from sgraph._src.random.threefry import threefry2x32

N = 1_000_000
MASK = 0xFFFFFFFF


def _word(v):
    return torch.tensor(v, dtype=torch.int64)


# Random123 known-answer vectors for threefry2x32_20: (key, counter, expected).
KNOWN_ANSWERS = [
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((MASK, MASK), (MASK, MASK), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,counter,expected", KNOWN_ANSWERS)
def test_threefry_known_answers(key, counter, expected):
    out = threefry2x32(*map(_word, key), *map(_word, counter))
    assert tuple(int(w) for w in out) == expected


def test_bits_are_threefry_of_counters():
    # key(0) is the all-zero key, and bits() hashes counter 0 first.
    assert sg.random.bits(sg.random.key(0), 2).tolist() == [0x6B200159, 0x99BA4EFE]


def test_key_words_from_seed():
    assert sg.random.key(2**32 + 5).tolist() == [1, 5]
    assert sg.random.key(-1).tolist() == [MASK, MASK]
    assert sg.random.key(2**64 - 1).tolist() == [MASK, MASK]


def test_same_key_gives_identical_bits():
    k = sg.random.key(42)
    assert torch.equal(sg.random.bits(k, (3, 1000)), sg.random.bits(k, (3, 1000)))
    assert torch.equal(sg.random.normal(k, 1001), sg.random.normal(k, 1001))


def test_different_seeds_differ():
    a = sg.random.bits(sg.random.key(0), 1000)
    b = sg.random.bits(sg.random.key(1), 1000)
    assert (a != b).float().mean() > 0.99


def test_split_keys_differ_from_each_other_and_parent():
    k = sg.random.key(7)
    keys = sg.random.split(k, 16)
    assert keys.shape == (16, 2) and keys.dtype == torch.int64
    rows = {tuple(r) for r in keys.tolist()} | {tuple(k.tolist())}
    assert len(rows) == 17
    assert torch.equal(sg.random.split(k, 4), keys[:4])  # prefix-stable
    assert sg.random.split(k, 1).shape == (1, 2)


def test_split_fold_in_and_bits_use_separate_counters():
    # A child key must not equal words the parent hands out through bits().
    k = sg.random.key(8)
    words = {tuple(r) for r in sg.random.bits(k, (64, 2)).tolist()}
    children = {tuple(r) for r in sg.random.split(k, 64).tolist()}
    folded = {tuple(sg.random.fold_in(k, i).tolist()) for i in range(64)}
    assert len(words | children | folded) == 3 * 64


def _corr(a, b):
    return torch.corrcoef(torch.stack((a, b)).double())[0, 1].abs().item()


def test_split_samples_are_uncorrelated():
    # The correlation of independent samples has standard error 1/sqrt(N) = 0.001.
    k = sg.random.key(3)
    k1, k2 = sg.random.split(k)
    a, b, c = (sg.random.uniform(x, N) for x in (k1, k2, k))
    assert _corr(a, b) < 0.01 and _corr(a, c) < 0.01 and _corr(b, c) < 0.01


def test_fold_in_differs_by_data_and_accepts_tensors():
    k = sg.random.key(0)
    folded = [tuple(sg.random.fold_in(k, d).tolist()) for d in (0, 1, 2, 2**40)]
    assert len(set(folded) | {tuple(k.tolist())}) == 5
    for d in (5, -1, 2**40):
        assert torch.equal(sg.random.fold_in(k, d), sg.random.fold_in(k, torch.tensor(d)))
    five = torch.tensor(5, dtype=torch.int32)
    assert torch.equal(sg.random.fold_in(k, 5), sg.random.fold_in(k, five))


SAMPLERS = {
    "bits": (lambda k, s: sg.random.bits(k, s), torch.int64),
    "uniform": (lambda k, s: sg.random.uniform(k, s), torch.float32),
    "uniform_bf16": (lambda k, s: sg.random.uniform(k, s, dtype=torch.bfloat16), torch.bfloat16),
    "uniform_f64": (lambda k, s: sg.random.uniform(k, s, dtype=torch.float64), torch.float64),
    "normal": (lambda k, s: sg.random.normal(k, s), torch.float32),
    "normal_f16": (lambda k, s: sg.random.normal(k, s, dtype=torch.float16), torch.float16),
    "bernoulli": (lambda k, s: sg.random.bernoulli(k, 0.3, s), torch.bool),
}


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("shape,expected", [(5, (5,)), ((2, 3), (2, 3)), ((), ()), ((0, 4), (0, 4))])
def test_output_shape_dtype_device(name, shape, expected):
    fn, dtype = SAMPLERS[name]
    out = fn(sg.random.key(1), shape)
    assert out.shape == expected and out.dtype == dtype and out.device == torch.device("cpu")


def test_bits_are_32_bit_words():
    b = sg.random.bits(sg.random.key(5), 100_000)
    assert b.min() >= 0 and b.max() < 2**32 and b.max() >= 2**31  # top bit is used


def test_uniform_moments_and_histogram():
    u = sg.random.uniform(sg.random.key(11), N).double()
    # mean: SE = sqrt(1/12 / N) = 2.9e-4; variance: SE = sqrt((1/80 - 1/144) / N) = 7.5e-5.
    assert abs(u.mean().item() - 0.5) < 6 * 2.9e-4
    assert abs(u.var().item() - 1 / 12) < 6 * 7.5e-5
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    expected = N / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 63.68  # chi-square, 19 degrees of freedom, p = 1e-6
    assert u.min() >= 0.0 and u.max() < 1.0


def test_uniform_float64_and_bounds():
    k = sg.random.key(12)
    u = sg.random.uniform(k, 100_000, dtype=torch.float64, minval=-2.0, maxval=3.0)
    assert u.min() >= -2.0 and u.max() < 3.0
    # 53-bit mantissas: most values are not representable in float32.
    assert (u.float().double() != u).float().mean() > 0.9
    v = sg.random.uniform(k, 100_000, minval=-2.0, maxval=3.0)
    assert abs(v.mean().item() - 0.5) < 6 * 5 / math.sqrt(12 * 100_000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("minval,maxval", [(0.0, 1.0), (-1.0, 1.0), (3.0, 7.0)])
def test_low_precision_uniform_never_reaches_maxval(dtype, minval, maxval):
    # Without clamping, float32 values within half an ulp of maxval round up to it
    # (a fraction 2**-9 for bfloat16, 2**-12 to 2**-11 for float16: 64+ of 2**18 draws),
    # so this fails if the clamp is missing.
    u = sg.random.uniform(sg.random.key(13), 2**18, dtype=dtype, minval=minval, maxval=maxval)
    top = torch.nextafter(torch.tensor(maxval, dtype=dtype), torch.tensor(-math.inf, dtype=dtype))
    assert u.dtype == dtype and u.min() >= minval and u.max() < maxval
    assert u.max() == top  # the top of the range is still reached


def test_normal_moments_and_ks():
    z = sg.random.normal(sg.random.key(21), N).double()
    # mean: SE = 1/sqrt(N) = 1e-3; variance: SE = sqrt(2/N) = 1.41e-3.
    assert abs(z.mean().item()) < 6 * 1e-3
    assert abs(z.var().item() - 1.0) < 6 * 1.41e-3
    cdf = torch.special.ndtr(z.sort().values)
    grid = torch.arange(N + 1, dtype=torch.float64) / N
    ks = torch.maximum(grid[1:] - cdf, cdf - grid[:-1]).max().item()
    assert ks < 0.0027  # Kolmogorov-Smirnov critical value at p = 1e-6: sqrt(ln(2e6) / 2N)


def test_bit_to_float_conversions_stay_in_range_at_extreme_words():
    w = torch.tensor([0, 1, 2**31, MASK - 1, MASK], dtype=torch.int64)
    assert unit24(w).tolist() == [0.0, 0.0, 0.5, 1 - 2**-24, 1 - 2**-24]
    assert unit53(w, w).max().item() == 1 - 2**-53 and unit53(w, w).min().item() == 0.0
    for compute in (torch.float32, torch.float64):
        z = box_muller(w.repeat_interleave(5), w.repeat(5), compute)
        assert torch.isfinite(z).all() and z.abs().max() < 6.8
        assert z.abs().max() > 6.6  # word 0 gives the largest radius, sqrt(2 ln 2**33)


def test_normal_is_finite_in_every_dtype():
    k = sg.random.key(22)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        z = sg.random.normal(k, 2**18, dtype=dtype)
        assert torch.isfinite(z).all() and z.abs().max() <= 6.8


def test_bernoulli_rate_and_edges():
    k = sg.random.key(31)
    # rate: SE = sqrt(0.3 * 0.7 / N) = 4.6e-4.
    assert abs(sg.random.bernoulli(k, 0.3, N).double().mean().item() - 0.3) < 6 * 4.6e-4
    assert not sg.random.bernoulli(k, 0.0, 10_000).any()
    assert sg.random.bernoulli(k, 1.0, 10_000).all()
    p = torch.tensor([0.0, 1.0]).repeat(5000)
    b = sg.random.bernoulli(k, p)
    assert b.shape == (10_000,) and torch.equal(b, p.bool())


def test_dropout_keeps_mean_and_drops_p():
    x = torch.ones(N)
    y = sg.random.dropout(sg.random.key(41), x, 0.25)
    # mean: SE = sqrt(p (1 - p)) / (1 - p) / sqrt(N) = 5.8e-4; zero rate: SE = 4.3e-4.
    assert abs(y.double().mean().item() - 1.0) < 6 * 5.8e-4
    assert abs((y == 0).double().mean().item() - 0.25) < 6 * 4.3e-4
    assert set(y.unique().tolist()) == {0.0, (torch.tensor(1.0) / 0.75).item()}


def test_dropout_identity_zeros_and_dtype():
    k = sg.random.key(42)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert sg.random.dropout(k, x, 0.0) is x
    assert sg.random.dropout(k, x, 0.5, training=False) is x
    assert torch.equal(sg.random.dropout(k, x, 1.0), torch.zeros_like(x))
    y = sg.random.dropout(k, x, 0.5)
    kept = y != 0
    assert y.dtype == torch.bfloat16 and torch.equal(y[kept], (x / 0.5)[kept])


def _random_ops(graph):
    banned = ("rand", "bernoulli", "normal", "uniform", "dropout", "exponential", "multinomial")
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    return [t for t in targets if any(b in t for b in banned) or "local_scalar" in t]


TRACED = {
    "uniform": lambda k: sg.random.uniform(k, (4,)),
    "uniform_bf16": lambda k: sg.random.uniform(k, (4,), dtype=torch.bfloat16, minval=-1, maxval=1),
    "normal": lambda k: sg.random.normal(k, (3, 5)),
    "split_fold_in": lambda k: sg.random.fold_in(sg.random.split(k, 3)[1], 9),
    "dropout": lambda k: sg.random.dropout(k, torch.ones(8), 0.5),
    "fold_in_tensor": lambda k: sg.random.bits(sg.random.fold_in(k, k[0] + 1), (6,)),
}


@pytest.mark.parametrize("name", TRACED)
def test_make_fx_fake_graph_has_no_rng_ops_and_matches_eager(name):
    fn, k = TRACED[name], sg.random.key(123)
    gm = make_fx(fn, tracing_mode="fake")(k)
    assert _random_ops(gm.graph) == []
    assert any("bitwise_xor" in str(n.target) for n in gm.graph.nodes)
    assert torch.equal(gm(k), fn(k))


@pytest.mark.gpu
def test_bits_and_uniform_bit_identical_on_cpu_and_cuda():
    cpu, gpu = sg.random.key(2024), sg.random.key(2024, device="cuda")
    assert sg.random.uniform(gpu, 10).device.type == "cuda"
    assert torch.equal(sg.random.bits(cpu, (1000, 3)), sg.random.bits(gpu, (1000, 3)).cpu())
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        a = sg.random.uniform(cpu, 10_000, dtype=dtype, minval=-3.0, maxval=5.0)
        b = sg.random.uniform(gpu, 10_000, dtype=dtype, minval=-3.0, maxval=5.0)
        assert torch.equal(a, b.cpu())
    ck, gk = sg.random.split(cpu, 3)[2], sg.random.split(gpu, 3)[2]
    assert torch.equal(sg.random.fold_in(ck, 7), sg.random.fold_in(gk, 7).cpu())
    torch.testing.assert_close(sg.random.normal(cpu, 1000), sg.random.normal(gpu, 1000).cpu())


@pytest.mark.gpu
def test_cuda_graph_capture_gives_fresh_samples_per_step():
    k = sg.random.key(9, device="cuda")
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    ones = torch.ones(1000, device="cuda")

    def draw():
        sk = sg.random.fold_in(k, step)
        u, z = sg.random.uniform(sk, 1000), sg.random.normal(sk, 1000)
        return u, z, sg.random.dropout(sk, ones, 0.5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        draw()  # warm up outside the capture, as torch.cuda.graph requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = draw()
    first = None
    for s in range(3):
        step.fill_(s)
        graph.replay()
        replayed = [t.clone() for t in captured]
        for got, want in zip(replayed, draw()):
            assert torch.equal(got, want)
        first = replayed if first is None else first
        assert s == 0 or not torch.equal(replayed[0], first[0])


K = sg.random.key(0)
ONES = torch.ones(4)
I64 = torch.ones(4, dtype=torch.int64)

# (call, error type, pattern naming the API, the argument, what was expected and found)
ERRORS = {
    "key_float": (
        lambda: sg.random.uniform(torch.zeros(3), 4),
        TypeError,
        r"sg\.random\.uniform: key must be an int64 tensor of shape \(2,\) made by "
        r"sg\.random\.key or split; found float32 tensor of shape \(3,\)",
    ),
    "key_unindexed_split": (
        lambda: sg.random.normal(sg.random.split(K, 3), 4),
        TypeError,
        r"sg\.random\.normal: key .*found int64 tensor of shape \(3, 2\); "
        r"index the result of split",
    ),
    "key_int": (
        lambda: sg.random.bits(0, 4),
        TypeError,
        r"sg\.random\.bits: key .*found int 0; make one with sg\.random\.key",
    ),
    "split_num": (
        lambda: sg.random.split(K, 0),
        ValueError,
        r"sg\.random\.split: num must be an int >= 1; found int 0",
    ),
    "seed": (
        lambda: sg.random.key(1.5),
        TypeError,
        r"sg\.random\.key: seed must be an int.*found float 1\.5",
    ),
    "fold_in_float": (
        lambda: sg.random.fold_in(K, 1.0),
        TypeError,
        r"sg\.random\.fold_in: data must be .*found float 1\.0",
    ),
    "fold_in_vector": (
        lambda: sg.random.fold_in(K, I64),
        TypeError,
        r"sg\.random\.fold_in: data must be .*0-d integer tensor; "
        r"found int64 tensor of shape \(4,\)",
    ),
    "uniform_dtype": (
        lambda: sg.random.uniform(K, 4, dtype=torch.int32),
        TypeError,
        r"sg\.random\.uniform: dtype must be a floating torch\.dtype; found torch\.int32",
    ),
    "normal_dtype": (
        lambda: sg.random.normal(K, 4, dtype=torch.int64),
        TypeError,
        r"sg\.random\.normal: dtype must be a floating torch\.dtype; found torch\.int64",
    ),
    "uniform_bounds": (
        lambda: sg.random.uniform(K, 4, minval=1.0, maxval=1.0),
        ValueError,
        r"sg\.random\.uniform: minval and maxval .*minval < maxval; found minval=1\.0, maxval=1\.0",
    ),
    "shape": (
        lambda: sg.random.uniform(K, (2, -1)),
        TypeError,
        r"sg\.random\.uniform: shape must be .*non-negative ints; found tuple \(2, -1\)",
    ),
    "bernoulli_p": (
        lambda: sg.random.bernoulli(K, 1.5, 4),
        ValueError,
        r"sg\.random\.bernoulli: p must be a probability, a number in \[0, 1\]; found float 1\.5",
    ),
    "bernoulli_p_shape": (
        lambda: sg.random.bernoulli(K, torch.full((3,), 0.5), (4,)),
        ValueError,
        r"sg\.random\.bernoulli: p of shape \(3,\) must broadcast to shape \(4,\)",
    ),
    "bernoulli_p_int_tensor": (
        lambda: sg.random.bernoulli(K, I64),
        TypeError,
        r"sg\.random\.bernoulli: a tensor p must be floating; found int64 tensor of shape \(4,\)",
    ),
    "dropout_p_negative": (
        lambda: sg.random.dropout(K, ONES, -0.1),
        ValueError,
        r"sg\.random\.dropout: p must be a probability.*found float -0\.1",
    ),
    "dropout_p_above_one": (
        lambda: sg.random.dropout(K, ONES, 1.1),
        ValueError,
        r"sg\.random\.dropout: p must be a probability.*found float 1\.1",
    ),
    "dropout_device": (
        lambda: sg.random.dropout(K, torch.ones(4, device="meta"), 0.5),
        ValueError,
        r"sg\.random\.dropout: key and x must be on one device; found key on cpu and x on meta",
    ),
    "dropout_int_x": (
        lambda: sg.random.dropout(K, I64, 0.5),
        TypeError,
        r"sg\.random\.dropout: x must be a floating tensor; found int64 tensor",
    ),
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors_name_api_argument_expected_found_and_fix(name):
    call, error, match = ERRORS[name]
    with pytest.raises(error, match=match) as info:
        call()
    assert re.search(r"; (pass|make|index|cast|reshape) ", str(info.value))  # the fix


def test_draws_from_a_key_passed_to_a_sharded_step_are_eagers(mesh):
    """Under sg.shard a key (or a counter folded into one) comes in as a replicated
    DTensor, on which DTensor took ``>>`` / ``<<`` for in-place ops and returned their
    input: uniform draws collapsed to a few values and dropout kept everything."""
    one = sg.mesh(dp=1, device_type="cpu")

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def step(key, count):
        key, sub = sg.random.split(sg.random.fold_in(key, count))
        shifted = (count >> 3, count << 3)  # the user's own shifts too
        return key, sg.random.uniform(sub, (4096,)), sg.random.dropout(sub, torch.ones(4096), 0.5), shifted

    key, count = sg.random.key(0), torch.tensor(77)
    want = step(key, count)
    for f in (sg.shard(one)(step), sg.static(sg.shard(one)(step))):
        got = sg.tree.map(full, f(key, count))
        for g, w in zip(sg.tree.leaves(got), sg.tree.leaves(want)):
            assert torch.equal(g, w)
