"""fused_zero.ops.norm_stats / norm_stats_many: kernel (interpreter on CPU) and twin."""
from __future__ import annotations

import pytest
import torch

from fused_zero import ops
from fused_zero.kernels import norm as norm_kernels
from fused_zero.kernels.norm import BLOCK

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZES = [1, BLOCK - 1, BLOCK + 1, 7919, 2**16 + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSED_ZERO_BACKEND", request.param)
    return request.param


def randn(n, dtype=torch.float32, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def expected_sq(*xs):
    return sum(torch.linalg.vector_norm(x.double()) ** 2 for x in xs)


def assert_stats(stats, sq, nonfinite):
    assert stats.sq_sum.shape == () and stats.nonfinite.shape == ()
    assert stats.sq_sum.dtype == torch.float32 and stats.sq_sum.device.type == DEVICE.type
    err = abs(stats.sq_sum.double().item() - float(sq)) / max(abs(float(sq)), 1e-300)
    assert err <= 1e-6, f"relative error {err:.3e}"
    assert stats.nonfinite.item() == nonfinite


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_float64_norm(backend, n, dtype):
    x = randn(n, dtype)
    assert_stats(ops.norm_stats(x), expected_sq(x), 0.0)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_single_nonfinite_detected(backend, value, where):
    n = 2 * BLOCK + 5
    for dtype in DTYPES:
        x = randn(n, dtype)
        x[{"first": 0, "middle": n // 2, "last": n - 1}[where]] = value
        assert ops.norm_stats(x).nonfinite.item() == 1.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_finite_values_are_not_nonfinite(backend, dtype):
    x = torch.full((BLOCK + 3,), 3e38, device=DEVICE).to(dtype)
    x[1] = -x[1]
    stats = ops.norm_stats(x)
    assert stats.sq_sum.item() == float("inf")  # the square overflows fp32 ...
    assert stats.nonfinite.item() == 0.0  # ... but every element is finite


def test_programs_loop_over_tiles(backend, monkeypatch):
    monkeypatch.setattr(norm_kernels, "MAX_PARTIALS", 3)  # more tiles than programs, cheaply
    n = 10 * BLOCK + 1
    assert norm_kernels.num_partials(n) == 3
    x = randn(n, torch.bfloat16, seed=4)
    assert_stats(ops.norm_stats(x), expected_sq(x), 0.0)
    x[n - 1] = float("nan")
    assert ops.norm_stats(x).nonfinite.item() == 1.0
    assert norm_kernels.num_partials(BLOCK * 10**6) == 3


def test_deterministic(backend):
    x = randn(2**16 + 3, seed=7) * 1e3
    a, b = ops.norm_stats(x), ops.norm_stats(x)
    assert torch.equal(a.sq_sum, b.sq_sum) and torch.equal(a.nonfinite, b.nonfinite)
    c = ops.norm_stats_many([x[:1000], x[1000:]])
    d = ops.norm_stats_many([x[:1000], x[1000:]])
    assert torch.equal(c.sq_sum, d.sq_sum)


def test_many_sums_over_buffers(backend):
    xs = [randn(BLOCK + 7, torch.float32, 1), torch.empty(0, device=DEVICE),
          randn(300, torch.bfloat16, 2), randn(5000, torch.float16, 3)]
    assert_stats(ops.norm_stats_many(xs), expected_sq(*xs), 0.0)
    xs[2][17] = float("-inf")
    assert ops.norm_stats_many(xs).nonfinite.item() == 1.0
    assert ops.norm_stats_many(iter(xs[:2])).nonfinite.item() == 0.0  # any iterable


def test_empty_inputs(backend):
    assert_stats(ops.norm_stats(torch.empty(0, device=DEVICE)), 0.0, 0.0)
    out = ops.NormStats(torch.full((), 5.0, device=DEVICE), torch.full((), 1.0, device=DEVICE))
    res = ops.norm_stats_many([], out=out)
    assert res.sq_sum.item() == 0.0 and res.nonfinite.item() == 0.0


def test_out_is_written_in_place(backend):
    x = randn(BLOCK + 1)
    out = ops.NormStats(torch.empty((), device=DEVICE), torch.full((), 1.0, device=DEVICE))
    res = ops.norm_stats(x, out=out)
    assert res.sq_sum.data_ptr() == out.sq_sum.data_ptr()
    assert res.nonfinite.data_ptr() == out.nonfinite.data_ptr()
    assert_stats(out, expected_sq(x), 0.0)


def test_kernel_matches_twin_closely(monkeypatch):
    xs = [randn(BLOCK * 3 + 11, torch.bfloat16, 5), randn(999, torch.float32, 6)]
    monkeypatch.setenv("FUSED_ZERO_BACKEND", "triton")
    kernel = ops.norm_stats_many(xs)
    monkeypatch.setenv("FUSED_ZERO_BACKEND", "torch")
    twin = ops.norm_stats_many(xs)
    torch.testing.assert_close(kernel.sq_sum, twin.sq_sum, rtol=1e-6, atol=0)
    assert torch.equal(kernel.nonfinite, twin.nonfinite)


BAD = [
    (lambda: ops.norm_stats(torch.zeros(3, 4)), ValueError, "x must be a flat 1-D buffer"),
    (lambda: ops.norm_stats(torch.zeros(10)[::2]), ValueError, "x must be contiguous"),
    (lambda: ops.norm_stats(torch.zeros(4, dtype=torch.float64)), TypeError,
     "x must have dtype float32, bfloat16, float16"),
    (lambda: ops.norm_stats([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    (lambda: ops.norm_stats_many([torch.zeros(3), torch.zeros(3, dtype=torch.int32)]), TypeError,
     r"tensors\[1\] must have dtype"),
    (lambda: ops.norm_stats_many([torch.zeros(3), torch.zeros(3, device="meta")]), ValueError,
     r"tensors\[1\] is on meta but tensors\[0\] is on cpu"),
    (lambda: ops.norm_stats_many(torch.zeros(3)), TypeError, "takes a list of flat buffers"),
    (lambda: ops.norm_stats_many([]), ValueError, "needs at least one tensor, or out="),
    (lambda: ops.norm_stats(torch.zeros(3), out=(torch.zeros(1), torch.zeros(()))), TypeError,
     "out.sq_sum must be a 0-d fp32 tensor"),
    (lambda: ops.norm_stats(torch.zeros(3), out=(torch.zeros(()), torch.zeros((), dtype=torch.int64))),
     TypeError, "out.nonfinite must be a 0-d fp32 tensor"),
    (lambda: ops.norm_stats(torch.zeros(3), out=(torch.zeros((), device="meta"), torch.zeros(()))),
     ValueError, "out.sq_sum is on meta but the input is on cpu"),
    (lambda: ops.norm_stats(torch.zeros(3), out=torch.zeros(2)), TypeError, "out must be a NormStats"),
]


@pytest.mark.parametrize("call, exc, match", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_arguments_raise(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
