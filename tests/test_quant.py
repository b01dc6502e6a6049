"""fused_zero.ops.quantize_ / dequantize_: block-wise absmax int8 / int4 codecs.

The Triton kernels (under TRITON_INTERPRET=1 on CPU tensors, or on CUDA) are bitwise equal to their torch
twins on odd sizes, several chunks, every input and output dtype (payload bytes, decoded values, sums);
the round trip stays within half a quantization step of each block; zeros, tiny blocks, inf and NaN
decode as kernels/quant.py says; bad arguments are refused naming the fix.
"""

import pytest
import torch

from _compiles import run_sm90_script
from fused_zero import ops
from fused_zero.ops._backend import interpreting
from fused_zero.ops.quant import QMAX

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
_KERNEL = []  # devices where the Triton kernel runs
if interpreting():
    _KERNEL.append("cpu")
if torch.cuda.is_available():
    _KERNEL.append("cuda")
_SENTINEL = 0xA5  # the payload's padding bytes are never written: both backends start from this


def _run(backend, monkeypatch, x, bits, block, chunks, out_dtype, seed=None):
    """(payload, every chunk decoded, the chunks' sum) with ``backend``."""
    monkeypatch.setenv("FUSED_ZERO_BACKEND", backend)
    n = x.numel() // chunks
    payload = torch.full((chunks * ops.payload_bytes(n, bits, block),), _SENTINEL, dtype=torch.uint8,
                         device=x.device)
    ops.quantize_(x, payload, bits=bits, block=block, chunks=chunks, seed=seed)
    each = ops.dequantize_(payload, torch.empty(x.numel(), dtype=out_dtype, device=x.device), bits=bits,
                           block=block, chunks=chunks)
    total = ops.dequantize_(payload, torch.empty(n, dtype=out_dtype, device=x.device), bits=bits, block=block,
                            chunks=chunks, sum_chunks=True)
    return payload.cpu(), each.cpu(), total.cpu()


def _same(a, b):
    """Bitwise equal, any NaN matching any NaN."""
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(0.0).view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.nan_to_num(0.0).view(torch.int16 if b.element_size() == 2 else torch.int32))


def _inputs(numel, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel).flip(0)[torch.randperm(numel, generator=g)]
    x[::17] = 0.0
    x[3::29] = -x[3::29].round()  # integers: ties after scaling
    if numel > 300:
        x[100] = float("inf")
        x[250] = float("nan")
        x[260:330] = 1e-31  # a tiny block at block size 32 and 64
    return x.to(dtype).to(device)


@pytest.mark.skipif(not _KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", _KERNEL)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("in_dtype,out_dtype", [(F32, F32), (BF16, BF16), (F16, F32), (F32, BF16), (F32, F16)])
@pytest.mark.parametrize("numel,chunks,block", [(1, 1, 256), (7, 1, 32), (333, 3, 32), (1002, 2, 64),
                                                (2 * 1061, 2, 256), (4100, 1, 1024), (3 * 1064, 3, 256)])
def test_kernels_bitwise_equal_to_twins(monkeypatch, device, bits, in_dtype, out_dtype, numel, chunks, block):
    x = _inputs(numel, in_dtype, device)
    kernel = _run("triton", monkeypatch, x, bits, block, chunks, out_dtype)
    twin = _run("torch", monkeypatch, x, bits, block, chunks, out_dtype)
    assert torch.equal(kernel[0], twin[0]), "payload bytes differ"
    _same(kernel[1], twin[1])
    _same(kernel[2], twin[2])


@pytest.mark.skipif(not _KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", _KERNEL)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("in_dtype", [F32, BF16])
@pytest.mark.parametrize("numel,chunks,block,seed", [(7, 1, 32, 0), (1002, 2, 64, 12345),
                                                     (2 * 1061, 2, 256, 2**31 - 1), (3 * 1064, 3, 256, 77)])
def test_stochastic_rounding_kernels_bitwise_equal_to_twins(monkeypatch, device, bits, in_dtype, numel, chunks,
                                                            block, seed):
    x = _inputs(numel, in_dtype, device)
    kernel = _run("triton", monkeypatch, x, bits, block, chunks, F32, seed=seed)
    twin = _run("torch", monkeypatch, x, bits, block, chunks, F32, seed=seed)
    assert torch.equal(kernel[0], twin[0]), "payload bytes differ"
    _same(kernel[1], twin[1])
    nearest = _run("torch", monkeypatch, x, bits, block, chunks, F32)
    assert numel < 100 or not torch.equal(twin[0], nearest[0])  # it rounds otherwise than to nearest


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_and_reproducible(bits):
    """Values 0.3 of a step above a grid point: to nearest they all round down (a bias of 0.3 step);
    stochastically 30% round up, so the mean over seeds is the value; a seed gives the same payload again."""
    block, n = 64, 64 * 8
    step = 1.0 / QMAX[bits]
    x = torch.full((n,), 0.3 * step)
    x[::block] = 1.0  # each block's absmax: the step is exactly 1 / QMAX
    size = ops.payload_bytes(n, bits, block)

    def decoded(seed):
        payload = ops.quantize_(x, torch.empty(size, dtype=torch.uint8), bits=bits, block=block, seed=seed)
        return ops.dequantize_(payload, torch.empty(n), bits=bits, block=block), payload

    rest = x != 1.0
    assert torch.equal(decoded(None)[0][rest], torch.zeros(int(rest.sum())))  # to nearest: all rounded down
    runs = torch.stack([decoded(seed)[0] for seed in range(200)])
    assert ((runs[:, rest] - x[rest]).abs() <= step * 1.0001).all()  # within one step
    mean = runs[:, rest].mean()
    assert abs(mean / (0.3 * step) - 1) < 0.05, mean / step  # 448 x 200 draws: unbiased to a few percent
    assert torch.equal(decoded(7)[1], decoded(7)[1]) and not torch.equal(decoded(7)[1], decoded(8)[1])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 256])
def test_round_trip_within_half_a_step_of_each_block(bits, block):
    n = 5 * block + 17
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 10.0
    payload = torch.empty(ops.payload_bytes(n, bits, block), dtype=torch.uint8)
    back = ops.dequantize_(ops.quantize_(x, payload, bits=bits, block=block), torch.empty(n), bits=bits, block=block)
    for s in range(0, n, block):
        blk, got = x[s:s + block], back[s:s + block]
        step = blk.abs().max() / QMAX[bits]
        assert (got - blk).abs().max() <= step * (0.5 + 1e-5)
        assert got.abs().max() == pytest.approx(blk.abs().max(), rel=1e-6)  # absmax survives
    assert (back - x).abs().max() > 0  # it is lossy: the bound above is not vacuous


def test_sum_of_chunks_is_the_chunk_order_fp32_sum():
    n, chunks = 300, 4
    x = torch.randn(n * chunks, generator=torch.Generator().manual_seed(2))
    payload = ops.quantize_(x, torch.empty(chunks * ops.payload_bytes(n, 8, 64), dtype=torch.uint8), block=64,
                            chunks=chunks)
    each = ops.dequantize_(payload, torch.empty(n * chunks), block=64, chunks=chunks).view(chunks, n)
    total = ops.dequantize_(payload, torch.empty(n), block=64, chunks=chunks, sum_chunks=True)
    expect = ((each[0] + each[1]) + each[2]) + each[3]
    assert torch.equal(total, expect)
    assert (total - x.view(chunks, n).sum(0)).abs().max() <= chunks * x.abs().max() / 254 * 1.001


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_tiny_inf_and_nan(bits):
    block = 32
    x = torch.randn(6 * block, generator=torch.Generator().manual_seed(3))
    x[:block] = 0.0  # all zeros: exact zeros
    x[block:2 * block] = 1e-30  # below TINY: sent as zeros
    x[2 * block + 5] = float("inf")  # a block holding inf: NaN throughout
    x[3 * block + 7] = float("nan")  # a block holding NaN: NaN throughout
    x[4 * block + 1] = -float("inf")
    payload = torch.empty(ops.payload_bytes(x.numel(), bits, block), dtype=torch.uint8)
    back = ops.dequantize_(ops.quantize_(x, payload, bits=bits, block=block), torch.empty_like(x), bits=bits,
                           block=block)
    assert torch.equal(back[:2 * block], torch.zeros(2 * block))
    assert not back[:2 * block].signbit().any()
    assert back[2 * block:5 * block].isnan().all()
    tail = back[5 * block:]
    assert tail.isfinite().all() and (tail - x[5 * block:]).abs().max() <= x[5 * block:].abs().max() / QMAX[bits]


def test_payload_bytes():
    assert ops.payload_bytes(256, 8, 256) == 256 + 4
    assert ops.payload_bytes(256, 4, 256) == 128 + 4
    assert ops.payload_bytes(7, 4, 32) == 4 + 4  # 4 bytes of nibbles, padded to a word, one scale
    assert ops.payload_bytes(513, 8, 256) == 516 + 12


def test_bad_arguments_refused_naming_the_fix():
    x = torch.randn(64)
    good = torch.empty(ops.payload_bytes(64, 8, 32), dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        ops.quantize_(x, good, bits=2, block=32)
    with pytest.raises(ValueError, match="power of two from 32 to 8192"):
        ops.quantize_(x, good, block=48)
    with pytest.raises(ValueError, match=r"payload_bytes\(n, bits, block\)"):
        ops.quantize_(x, good[:-4], block=32)
    with pytest.raises(ValueError, match="chunks must be a positive int dividing"):
        ops.quantize_(x, good, block=32, chunks=3)
    with pytest.raises(TypeError, match="payload must have dtype uint8"):
        ops.quantize_(x, good.view(torch.int8), block=32)
    with pytest.raises(ValueError, match="4-byte aligned"):
        ops.dequantize_(torch.empty(good.numel() + 1, dtype=torch.uint8)[1:], torch.empty(64), block=32)
    for seed in (-1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be None \(round to nearest\) or an int in \[0, 2\*\*31\)"):
            ops.quantize_(x, good, block=32, seed=seed)


def test_quant_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter accepts kernels that Triton's compiler refuses (these once failed on the GPU): compile
    every quantize / dequantize variant for an H100/H200 (frontend, LLVM and ptxas from the triton wheel) in
    a process without TRITON_INTERPRET and a fresh cache; the aligned fp32 launches load (quantize) and store
    (dequantize, every output dtype) 128 bits at a time and convert no integer to float or back (outside the
    stochastic hash): what kernels/quant.py's speed rests on."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    if torch.cuda.is_available():
        pytest.skip("with a GPU the tests above compile and run the kernels themselves (saves ~20 s of a GPU session)")
    stdout = run_sm90_script("_quant_sm90.py", tmp_path)
    assert "128-bit loads and stores: yes" in stdout
    assert "no int/float conversion: yes" in stdout


@pytest.mark.skipif(not _KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", _KERNEL)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,chunks", [(2 * 2048, 2), (2 * 2047, 2)])
def test_kernels_bitwise_equal_to_twins_on_random_bit_patterns(monkeypatch, device, bits, numel, chunks):
    """Every exponent, subnormals, -0, values near the largest float: the kernels work on the bits (the absmax
    and non-finite test as one integer max, q off the bits of y + 1.5 * 2**23), so they meet the twins there
    too. ~0.4% of the elements NaN and two infinite (most blocks of 32 stay finite); even n takes int4's paired
    loads, odd n its split one."""
    g = torch.Generator().manual_seed(5)
    bits_ = torch.randint(-2**31, 2**31, (numel,), generator=g, dtype=torch.int64).to(torch.int32)
    exponent = (bits_ >> 23) & 0xFF
    bits_ = torch.where(exponent == 0xFF, bits_ & ~(1 << 30), bits_)  # most inf/NaN made finite
    bits_[::257] |= 0x7F800000  # some back: NaN (a random mantissa)
    bits_[100], bits_[1000] = 0x7F800000, -0x800000  # inf, -inf
    x = bits_.view(torch.float32).to(device)
    for out_dtype in (F32, BF16):
        kernel = _run("triton", monkeypatch, x, bits, 32, chunks, out_dtype)
        twin = _run("torch", monkeypatch, x, bits, 32, chunks, out_dtype)
        assert torch.equal(kernel[0], twin[0]), "payload bytes differ"
        _same(kernel[1], twin[1])
        _same(kernel[2], twin[2])
