"""fused_zero.ops.cast_: bitwise round-to-nearest-even and stochastic rounding.

Every test runs on the Triton kernel (under TRITON_INTERPRET=1 on CPU tensors,
or on CUDA) and on its torch twin, chosen with FUSED_ZERO_BACKEND.
"""
import pytest
import torch

from fused_zero import ops
from fused_zero.ops._backend import interpreting
from fused_zero.kernels.cast import BLOCK

_CASES = [("cpu", "torch")]
if torch.cuda.is_available():
    _CASES += [("cuda", "triton"), ("cuda", "torch")]
if interpreting():
    _CASES += [("cpu", "triton")]

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.fixture(params=_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def dev(request, monkeypatch):
    device, backend = request.param
    monkeypatch.setenv("FUSED_ZERO_BACKEND", backend)
    return device


def _f32(bits) -> torch.Tensor:
    """fp32 tensor from a list/tensor of uint32 bit patterns."""
    b = torch.as_tensor(bits, dtype=torch.int64) & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _assert_same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise equal, except that any NaN matches any NaN."""
    out, ref = out.cpu(), ref.cpu()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), "NaN positions differ"
    ob, rb = out.view(_BITS[out.dtype]), ref.view(_BITS[ref.dtype])
    bad = torch.nonzero((ob != rb) & ~nan).flatten()
    assert len(bad) == 0, (
        f"{len(bad)} mismatches, first at {bad[0].item()}: got {out[bad[0]].item()!r} "
        f"want {ref[bad[0]].item()!r}"
    )


def _cast(src, dtype, **kw):
    dst = torch.empty(src.numel(), dtype=dtype, device=src.device)
    out = ops.cast_(src, dst, **kw)
    assert out is dst
    return dst


def _special(dtype) -> torch.Tensor:
    """fp32 values where rounding to ``dtype`` is easy to get wrong."""
    vals = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000,             # +-0, +-inf
            0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF,  # NaNs
            0x00000001, 0x80000001, 0x007FFFFF, 0x00400000, 0x00008000,  # fp32 subnormals
            0x00018000, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,  # top of the range
            0x7F7F7FFF, 0x3FFFFFFF, 0xBF7FFFFF, 0x3F7F8000, 0x3F7F7FFF]
    for hi in (0x3F80, 0x3F81, 0x0001, 0x0002, 0x807E, 0x7F7E):         # bf16 ties, even/odd
        vals += [(hi << 16) | 0x8000, (hi << 16) | 0x7FFF, (hi << 16) | 0x8001]
    out = [_f32(vals)]
    if dtype == torch.float16:
        h = torch.tensor([1, 2, 0x3C00, 0x3C01, 0x03FF, 0x0400, 0x7BFE, 0x7BFF], dtype=torch.int16)
        lo = h.view(torch.float16).float()
        nxt = (h + 1).view(torch.float16).float()
        mid = (lo + nxt) / 2  # exact in fp32: ties at both parities
        out += [lo, mid, -mid, torch.nextafter(mid, nxt), torch.nextafter(mid, lo)]
        out.append(torch.tensor([65504.0, 65519.996, 65520.0, 1e5, 2047.9999, 2.0**-24, 2.0**-25,
                                 2.0**-25 * 1.0000001, 2.0**-26, 2.0**-14 * 0.99999, -2.0**-25, 6e-8]))
    else:
        out.append(torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38, 3.39e38, -3.4e38, 1e-40]))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK + 1, 7919, 2**16 + 3])
def test_rne_random_bits_bitwise(dev, dtype, n):
    gen = torch.Generator().manual_seed(n)
    src = _f32(torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)).to(dev)
    _assert_same(_cast(src, dtype), src.cpu().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rne_special_values_bitwise(dev, dtype):
    src = _special(dtype)
    src = torch.cat([src, -src]).to(dev)
    _assert_same(_cast(src, dtype), src.cpu().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rne_every_exponent_with_ties(dev, dtype):
    # each of the 256 exponents x 2 signs, with mantissas at and around ties
    e = torch.arange(512, dtype=torch.int64) << 23
    m = torch.tensor([0, 1, 0x1000, 0x1FFF, 0x2000, 0x6000, 0x7FFF, 0x8000, 0x8001, 0x18000, 0x7FFFFF])
    src = _f32((e[:, None] | m[None, :]).flatten()).to(dev)
    _assert_same(_cast(src, dtype), src.cpu().to(dtype))


def test_fp32_dst_is_a_copy(dev):
    gen = torch.Generator().manual_seed(1)
    src = _f32(torch.randint(0, 2**32, (BLOCK + 5,), generator=gen, dtype=torch.int64)).to(dev)
    _assert_same(_cast(src, torch.float32), src)


def test_empty(dev):
    src = torch.empty(0, device=dev)
    assert _cast(src, torch.bfloat16).numel() == 0


def _neighbours(src: torch.Tensor):
    """bf16 bit patterns just below and above |src| (same sign), as int64."""
    bits = src.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = bits >> 16
    return lo, torch.where((bits & 0xFFFF) == 0, lo, lo + 1)


def _u16(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16).to(torch.int64) & 0xFFFF


def test_stochastic_deterministic_and_between_neighbours(dev):
    gen = torch.Generator().manual_seed(2)
    src = (torch.randn(3 * BLOCK + 7, generator=gen) * 10.0 ** torch.randint(-30, 30, (3 * BLOCK + 7,),
                                                                                 generator=gen))
    src = torch.cat([src, torch.tensor([0.0, -0.0, 1.0, -2.0, 1e-42, -3e-41, 3.3e38])]).to(dev)
    a = _u16(_cast(src, torch.bfloat16, stochastic=True, seed=123))
    b = _u16(_cast(src, torch.bfloat16, stochastic=True, seed=123))
    c = _u16(_cast(src, torch.bfloat16, stochastic=True, seed=124))
    assert torch.equal(a, b), "same seed must give the same bits"
    assert not torch.equal(a, c), "different seeds should differ"
    lo, hi = _neighbours(src.cpu())
    assert bool(((a == lo) | (a == hi)).all()), "result must be one of the two bf16 neighbours"
    exact = lo == hi
    assert bool((a[exact] == lo[exact]).all()), "bf16-representable values must stay exact"
    assert 0.2 < (a[~exact] == hi[~exact]).double().mean() < 0.8


def test_stochastic_specials(dev):
    src = _f32([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F7FFFFF]).to(dev)
    out = _cast(src, torch.bfloat16, stochastic=True, seed=7).cpu().float()
    assert out[0] == float("inf") and out[1] == float("-inf")
    assert torch.isnan(out[2]) and torch.isnan(out[3])
    assert out[4] in (float("inf"), 3.3895313892515355e38)


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2.0**-7, -3.1e-3, 5.5e-39, 1234.567])
def test_stochastic_unbiased(dev, value):
    n = 1 << 14
    src = torch.full((n,), value, device=dev)
    out = _cast(src, torch.bfloat16, stochastic=True, seed=99).cpu().double()
    x = src[0].item()  # the fp32 value being rounded
    vals = out.unique().tolist()
    assert len(vals) == 2, f"expected both neighbours, got {vals}"
    lo, hi = vals
    assert lo < x < hi
    p = (x - lo) / (hi - lo)
    sigma = (hi - lo) * (p * (1 - p) / n) ** 0.5
    assert abs(out.mean().item() - x) < 5 * sigma
    assert abs((out == hi).double().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5


def test_bad_arguments(dev):
    src = torch.randn(8, device=dev)
    dst = torch.empty(8, dtype=torch.bfloat16, device=dev)
    with pytest.raises(TypeError, match="src must have dtype float32"):
        ops.cast_(src.half(), dst)
    with pytest.raises(TypeError, match="dst must have dtype float32, bfloat16, float16"):
        ops.cast_(src, dst.to(torch.int16))
    with pytest.raises(ValueError, match="dst has 7 elements but src has 8"):
        ops.cast_(src, dst[:7])
    with pytest.raises(ValueError, match="flat 1-D"):
        ops.cast_(src.view(2, 4), dst)
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.cast_(torch.randn(16, device=dev)[::2], dst)
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        ops.cast_([1.0] * 8, dst)
    with pytest.raises(ValueError, match="bfloat16 dst only"):
        ops.cast_(src, dst.half(), stochastic=True)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        ops.cast_(src, dst, stochastic=True, seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        ops.cast_(src, dst, stochastic=True, seed=1.5)
    with pytest.raises(TypeError, match="stochastic must be True or False"):
        ops.cast_(src, dst, stochastic=1)
    with pytest.raises(ValueError, match="overlap in memory"):
        ops.cast_(src, src)
    if torch.cuda.is_available():
        other = "cpu" if dev == "cuda" else "cuda"
        with pytest.raises(ValueError, match="move them to one device"):
            ops.cast_(src, dst.to(other))
