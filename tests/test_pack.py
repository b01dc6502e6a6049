"""fused_zero.ops.pack_ / unpack_ / pack_plan: bucket packing of many tensors.

Every test runs on the Triton kernel (under TRITON_INTERPRET=1 on CPU tensors,
or on CUDA) and on its torch twin, chosen with FUSED_ZERO_BACKEND. Expected
values are computed here per tensor with torch ops.
"""

import numpy as np
import pytest
import torch

from _compiles import run_sm90_script
from fused_zero import ops
from fused_zero.ops._backend import interpreting
from fused_zero.kernels import pack as kpack
from fused_zero.kernels.pack import BLOCK

_CASES = [("cpu", "torch")]
if torch.cuda.is_available():
    _CASES += [("cuda", "triton"), ("cuda", "torch")]
if interpreting():
    _CASES += [("cpu", "triton")]

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
_BITS = {BF16: torch.int16, F16: torch.int16, F32: torch.int32}
_SENTINEL = -7.25  # exact in every dtype: gaps must keep it


@pytest.fixture(params=_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def dev(request, monkeypatch):
    device, backend = request.param
    monkeypatch.setenv("FUSED_ZERO_BACKEND", backend)
    return device


def _bits(t):
    return t.detach().cpu().reshape(-1).view(_BITS[t.dtype])


def _assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    bad = torch.nonzero(_bits(a) != _bits(b)).flatten()
    assert len(bad) == 0, f"{len(bad)} mismatches, first at {bad[0].item()}"


def _make(specs, dev, seed=0):
    """Tensors from (shape, dtype) specs with values spanning many exponents."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in specs:
        n = torch.Size(shape).numel()
        x = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-12, 12, (n,), generator=gen).float()
        out.append(x.to(dtype).reshape(shape).to(dev))
    return out


def _layout(tensors, gap=3, numels=None):
    """Offsets with gaps between ranges; returns offsets and the bucket size."""
    offsets, pos = [], 1
    for i, t in enumerate(tensors):
        offsets.append(pos)
        pos += (t.numel() if t is not None else numels[i]) + gap
    return offsets, pos + 2


def _expected(bucket, tensors, offsets, numels=None, accumulate=False, scale=None):
    """Reference in plain torch: fp32 math per tensor, one rounding."""
    out = bucket.clone()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        n = numels[i] if t is None else t.numel()
        seg = out[off:off + n]
        if t is None:
            if not accumulate:
                seg.zero_()
            continue
        v = t.reshape(-1).float()
        if scale is not None:
            v = v * scale
        if accumulate:
            v = v + seg.float()
        seg.copy_(v)
    return out


_MIXED = [((1,), F32), ((3, 5), BF16), ((BLOCK,), F16), ((BLOCK + 1,), F32), ((2, 3, 7), F32),
          ((BLOCK - 1,), BF16), ((2 * BLOCK + 13,), F32), ((0,), BF16), ((11, 1), F16)]


@pytest.mark.parametrize("bdtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_pack_unpack_mixed(dev, bdtype):
    tensors = _make(_MIXED, dev)
    offsets, size = _layout(tensors)
    bucket = torch.full((size,), _SENTINEL, dtype=bdtype, device=dev)
    want = _expected(bucket, tensors, offsets)
    assert ops.pack_(tensors, bucket, offsets) is bucket
    _assert_bitwise(bucket, want)  # gaps keep the sentinel, ranges are copy_ casts
    outs = [torch.empty_like(t) for t in tensors]
    ops.unpack_(bucket, outs, offsets)
    for o, off in zip(outs, offsets):
        _assert_bitwise(o.reshape(-1), bucket[off:off + o.numel()].to(o.dtype))


def test_round_trip_fp32_bucket_is_exact(dev):
    tensors = _make(_MIXED, dev, seed=1)
    offsets, size = _layout(tensors, gap=5)
    bucket = torch.full((size,), _SENTINEL, device=dev)
    ops.pack_(tensors, bucket, offsets)
    outs = [torch.full_like(t, 3.0) for t in tensors]
    ops.unpack_(bucket, outs, offsets)
    for o, t in zip(outs, tensors):
        _assert_bitwise(o, t)


def test_same_dtype_copy_keeps_nan_bits(dev):
    raw = torch.tensor([0x7FC00001, -1, 0x7F800001, 5, -(2**31)], dtype=torch.int32)
    t = raw.view(torch.float32).to(dev)
    bucket = torch.zeros(9, device=dev)
    ops.pack_([t], bucket, [2])
    _assert_bitwise(bucket[2:7], t)


def test_many_tiny_tensors(dev):
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 40, (1000,), generator=gen).tolist()
    dtypes = [(F32, BF16, F16)[i % 3] for i in range(1000)]
    tensors = _make(list(zip([(s,) for s in sizes], dtypes)), dev, seed=3)
    offsets, size = _layout(tensors, gap=1)
    bucket = torch.full((size,), _SENTINEL, device=dev)
    ops.pack_(tensors, bucket, offsets)
    _assert_bitwise(bucket, _expected(torch.full_like(bucket, _SENTINEL), tensors, offsets))
    outs = [torch.empty_like(t) for t in tensors]
    ops.unpack_(bucket, outs, offsets)
    for o, t in zip(outs, tensors):
        _assert_bitwise(o, t)


def _same_or_nan(a, b):
    nan = torch.isnan(b.cpu())
    assert torch.equal(torch.isnan(a.cpu()), nan)
    assert torch.equal(_bits(a)[~nan.reshape(-1)], _bits(b)[~nan.reshape(-1)])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_rounding_on_random_bits(dev, dtype):
    gen = torch.Generator().manual_seed(8)
    raw = torch.randint(0, 2**32, (BLOCK + 300,), generator=gen, dtype=torch.int64)
    raw[:64] = (raw[:64] & ~0xFFFF) | 0x8000  # bf16 ties
    x = torch.where(raw >= 2**31, raw - 2**32, raw).to(torch.int32).view(F32)
    x = torch.cat([x, torch.tensor([65519.99, 65520.0, 3.4e38, 2.0**-25, 1e-45, -0.0])]).to(dev)
    bucket = torch.zeros(x.numel() + 2, dtype=dtype, device=dev)
    ops.pack_([x], bucket, [1])  # fp32 -> narrow dtype: round to nearest even
    _same_or_nan(bucket[1:-1], x.to(dtype))
    wide = x.clone()
    out = torch.empty(x.numel(), dtype=dtype, device=dev)
    ops.unpack_(wide, [out], [0])  # fp32 bucket -> narrow tensor: the same rounding
    _same_or_nan(out, x.to(dtype))


def test_int64_offsets_in_tables():
    rows = kpack._rows(np.array([7]), np.array([2**33 + 5]), np.array([BLOCK + 7]), np.array([kpack.CODES[BF16]]))
    assert rows.dtype == np.int64
    assert rows[:, 0].tolist() == [7, 7]  # entry index: addresses live in their own vector
    assert rows[:, 1].tolist() == [0, BLOCK]  # element offset in the entry
    assert rows[:, 2].tolist() == [2**33 + 5, 2**33 + 5 + BLOCK]
    assert rows[:, 3].tolist() == [BLOCK * 4 + 1, 7 * 4 + 1]  # length * 4 + dtype code


@pytest.mark.parametrize("bdtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("accumulate,scale", [(False, 0.125), (False, 1 / 3), (True, None),
                                              (True, 1 / 3), (True, -0.5)])
def test_scale_and_accumulate(dev, bdtype, accumulate, scale):
    specs = [((5,), F32), ((BLOCK + 3,), BF16), ((7, 3), F16), ((BLOCK,), F32)]
    tensors = _make(specs, dev, seed=4)
    offsets, size = _layout(tensors)
    bucket = _make([((size,), bdtype)], dev, seed=5)[0]
    start = bucket.clone()
    want = _expected(bucket, tensors, offsets, accumulate=accumulate, scale=scale)
    ops.pack_(tensors, bucket, offsets, accumulate=accumulate, scale=scale)
    _assert_bitwise(bucket, want)
    # against float64: fp32 math then one rounding to the bucket's dtype
    s = 1.0 if scale is None else scale
    eps = {F32: 2.0**-22, BF16: 2.0**-8, F16: 2.0**-10}[bdtype]
    for t, off in zip(tensors, offsets):
        seg = slice(off, off + t.numel())
        ref = t.reshape(-1).double() * s + (start[seg].double() if accumulate else 0.0)
        mag = t.reshape(-1).double().abs() * abs(s) + (start[seg].double().abs() if accumulate else 0.0)
        tiny = 2.0**-24 if bdtype == F16 else 1e-37
        assert bool(((bucket[seg].double() - ref).abs() <= eps * mag + tiny).all())


@pytest.mark.parametrize("bdtype", [F32, BF16], ids=["f32", "bf16"])
def test_scale_over_ranges_end_to_end_and_apart(dev, bdtype):
    """The scale after a plain copy runs over runs of adjacent ranges (pack_twin's ``_runs``): ranges end to end are
    scaled together, the gaps between runs keep their values, and a plan reused on two buffers in turn (the pool
    buffers) scales each buffer's own ranges."""
    tensors = _make([((5,), bdtype), ((BLOCK + 3,), bdtype), ((7, 3), bdtype), ((2,), bdtype), ((9,), bdtype)],
                    dev, seed=8)
    offsets, pos = [], 0
    for i, t in enumerate(tensors):  # the first three end to end, then a gap, the last two end to end
        pos += 4 if i == 3 else 0
        offsets.append(pos)
        pos += t.numel()
    size = pos + 3
    plan = ops.pack_plan(tensors, offsets, torch.empty(size, dtype=bdtype, device=dev))
    for _ in range(2):
        for bucket in (torch.full((size,), _SENTINEL, dtype=bdtype, device=dev),
                       torch.full((size,), _SENTINEL, dtype=bdtype, device=dev)):
            want = _expected(bucket.clone(), tensors, offsets, scale=1 / 3)
            ops.pack_(tensors, bucket, plan=plan, scale=1 / 3)
            _assert_bitwise(bucket, want)


def test_none_entries(dev):
    tensors = _make([((4,), F32), ((BLOCK + 2,), BF16), ((3,), F16)], dev, seed=6)
    entries = [tensors[0], None, tensors[1], None, tensors[2]]
    numels = [4, 5, BLOCK + 2, BLOCK + 9, 3]
    offsets, size = _layout(entries, numels=numels)
    for scale in (None, -2.0, 1 / 3):  # (1/3: fp32 math rounded once, as the kernel, not torch's CPU _foreach_mul_)
        bucket = torch.full((size,), _SENTINEL, dtype=BF16, device=dev)
        ops.pack_(entries, bucket, offsets, numels=numels, scale=scale)
        _assert_bitwise(bucket, _expected(torch.full_like(bucket, _SENTINEL), entries, offsets, numels,
                                          scale=scale))  # zeros are +0, gaps kept
    before = bucket.clone()
    ops.pack_(entries, bucket, offsets, numels=numels, accumulate=True)
    _assert_bitwise(bucket, _expected(before, entries, offsets, numels, accumulate=True))
    assert bool((bucket[offsets[1]:offsets[1] + 5] == 0).all())  # accumulate keeps a None range
    outs = [torch.empty_like(t) if t is not None else None for t in entries]
    ops.unpack_(bucket, outs, offsets)
    for o, off in zip(outs, offsets):
        if o is not None:
            _assert_bitwise(o, bucket[off:off + o.numel()].to(o.dtype))
    only_none = torch.full((8,), _SENTINEL, device=dev)
    ops.pack_([None, None], only_none, [0, 5], numels=[2, 3])
    assert only_none.tolist() == [0, 0, _SENTINEL, _SENTINEL, _SENTINEL, 0, 0, 0]


def test_plan_reuse_and_stale_pointers(dev, monkeypatch):
    specs = [((BLOCK + 1,), F32), ((6,), BF16), ((3, 3), F32)]
    tensors = _make(specs, dev, seed=7)
    offsets, size = _layout(tensors)
    bucket = torch.zeros(size, device=dev)
    plan = ops.pack_plan(tensors, offsets, bucket)
    ops.pack_(tensors, bucket, plan=plan)
    table = plan.state.get("table")
    ops.pack_(tensors, bucket, offsets, plan=plan)
    assert plan.state.get("table") is table  # same tensors: table reused
    # new tensors (fresh grads) while the old ones still hold other values
    fresh = [t * 2 + 1 for t in tensors]
    ops.pack_(fresh, bucket, plan=plan)
    _assert_bitwise(bucket, _expected(torch.zeros_like(bucket), fresh, offsets))
    assert plan.state.get("table") is table  # new addresses, same dtypes: the table stays
    del tensors
    fresh2 = [t - 3 for t in fresh]
    del fresh
    ops.pack_(fresh2, bucket, plan=plan)
    _assert_bitwise(bucket, _expected(torch.zeros_like(bucket), fresh2, offsets))
    outs = [torch.empty_like(t) for t in fresh2]
    ops.unpack_(bucket, outs, plan=plan)
    for o, t in zip(outs, fresh2):
        _assert_bitwise(o, t)
    # another dtype at an address the plan has seen: the tables are rebuilt
    base = torch.zeros(12, dtype=BF16, device=dev)
    base[:6] = fresh2[1]
    ops.pack_([fresh2[0], base[:6], fresh2[2]], bucket, plan=plan)
    other = [fresh2[0], base.view(F32)[:6], fresh2[2]]
    assert other[1].data_ptr() == base.data_ptr()
    ops.pack_(other, bucket, plan=plan)
    _assert_bitwise(bucket, _expected(torch.zeros_like(bucket), other, offsets))
    with pytest.raises(ValueError, match="offsets differ from the plan's"):
        ops.pack_(fresh2, bucket, [o + 1 for o in offsets], plan=plan)
    with pytest.raises(ValueError, match=r"tensors\[2\] has 8 elements but its range has 9"):
        ops.pack_(fresh2[:2] + [torch.zeros(8, device=dev)], bucket, plan=plan)
    with pytest.raises(ValueError, match="plan was built for a torch.float32 bucket"):
        ops.pack_(fresh2, bucket.bfloat16(), plan=plan)
    with pytest.raises(ValueError, match="tensors has 2 entries but the plan has 3"):
        ops.pack_(fresh2[:2], bucket, plan=plan)
    with pytest.raises(TypeError, match="plan must be a PackPlan"):
        ops.pack_(fresh2, bucket, plan=(1, 2))


_TRITON = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="needs Triton")


def _triton_dev(monkeypatch):
    monkeypatch.setenv("FUSED_ZERO_BACKEND", "triton")
    return "cuda" if torch.cuda.is_available() else "cpu"


@_TRITON
def test_tables(monkeypatch):
    dev = _triton_dev(monkeypatch)
    bucket = torch.zeros(3 * BLOCK, device=dev)
    table = kpack.build_table([F32, BF16, F32, None], [0, 2 * BLOCK + 8, 2 * BLOCK + 16, 2 * BLOCK + 32],
                              [2 * BLOCK + 5, 7, 4, 3], bucket)
    assert (table.copy_rows, table.aligned) == (5, True)
    assert table.codes == 1 << kpack.CODES[F32] | 1 << kpack.CODES[BF16] | 1 << kpack.ZERO
    rows = table.rows.cpu()
    assert rows.dtype == torch.int64
    assert rows[:, 0].tolist() == [0, 0, 0, 1, 2, 3]  # copy rows in entry order, then the zero fill
    assert (rows[:, 3] >> 2).tolist() == [BLOCK, BLOCK, 5, 7, 4, 3]  # lengths per chunk
    assert (rows[:, 3] & 3).tolist() == [0, 0, 0, 1, 0, kpack.ZERO]
    assert rows[:, 2].tolist() == [0, BLOCK, 2 * BLOCK, 2 * BLOCK + 8, 2 * BLOCK + 16, 2 * BLOCK + 32]
    odd = kpack.build_table([F32, BF16], [1, 2 * BLOCK + 8], [2 * BLOCK + 5, 7], bucket)
    assert not odd.aligned


def _count_launches(monkeypatch):
    grids = []
    real = kpack._launch
    monkeypatch.setattr(kpack, "_launch", lambda *a, **k: grids.append(a[3]) or real(*a, **k))
    return grids


@_TRITON
def test_one_launch_per_pack_call_for_mixed_dtypes(monkeypatch):
    dev = _triton_dev(monkeypatch)
    grids = _count_launches(monkeypatch)
    tensors = _make([((BLOCK * 2 + 5,), F32), ((7,), BF16), ((4,), F16), ((BLOCK,), BF16)], dev)
    entries = tensors[:3] + [None, tensors[3]]
    numels = [2 * BLOCK + 5, 7, 4, 3, BLOCK]
    offsets, size = _layout(entries, numels=numels)
    bucket = torch.full((size,), _SENTINEL, device=dev)
    plan = ops.pack_plan(entries, offsets, bucket, numels=numels)
    for call in range(3):
        grids.clear()
        ops.pack_(entries, bucket, plan=plan, scale=0.5)
        assert grids == [7]  # one launch: 6 copy rows of three dtypes, the zero-fill row last
        grids.clear()
        ops.pack_(entries, bucket, plan=plan, accumulate=True)
        assert grids == [6]  # accumulating: the zero-fill row is left out of the grid
        grids.clear()
        ops.pack_checked_(plan, entries, bucket)
        assert grids == [7]
    _assert_bitwise(bucket, _expected(torch.full_like(bucket, _SENTINEL), entries, offsets, numels))
    outs = [None if t is None else torch.empty_like(t) for t in entries]
    grids.clear()
    ops.unpack_(bucket, outs, offsets)
    assert grids == [6]
    for o, t in zip(outs, entries):
        if t is not None:
            _assert_bitwise(o, t)


@_TRITON
@pytest.mark.parametrize("entry", ["pack_", "pack_checked_"])
def test_changed_tensor_address_is_picked_up(monkeypatch, entry):
    """A plan reused with tensors at new addresses (p.data replaced, a new .grad each step, the
    old memory freed and reused) writes from the new tensors, never through a stale address."""
    dev = _triton_dev(monkeypatch)
    pack = (lambda ts, b, plan: ops.pack_(ts, b, plan=plan)) if entry == "pack_" else \
        (lambda ts, b, plan: ops.pack_checked_(plan, ts, b))
    tensors = _make([((BLOCK + 3,), F32), ((5,), BF16), ((2, 4), F32)], dev, seed=11)
    offsets, size = _layout(tensors)
    bucket = torch.zeros(size, device=dev)
    plan = ops.pack_plan(tensors, offsets, bucket)
    pack(tensors, bucket, plan)
    table, addrs = plan.state["table"], plan.state["addrs"]
    pack(tensors, bucket, plan)
    assert plan.state["addrs"] is addrs  # unchanged addresses: nothing uploaded
    for step in range(3):
        moved = [t.clone() + step + 1 for t in tensors]  # new storage for every entry ...
        tensors[1] = tensors[1].clone()  # ... and, in place of one, yet another
        moved[1] = tensors[1] * 3
        pack(moved, bucket, plan)
        _assert_bitwise(bucket, _expected(torch.zeros_like(bucket), moved, offsets))
        assert plan.state["addrs"] is not addrs and plan.state["table"] is table  # addresses only
        addrs = plan.state["addrs"]
    param = torch.nn.Parameter(tensors[0].clone())
    entries = [param, tensors[1], tensors[2]]
    pack(entries, bucket, plan)
    param.data = torch.full_like(param, 2.5)  # same tensor object, new storage
    pack(entries, bucket, plan)
    _assert_bitwise(bucket[offsets[0]:offsets[0] + param.numel()], param.detach())
    if entry == "pack_":  # another dtype at the same address: validated, and the table rebuilt
        base = torch.zeros(10, dtype=BF16, device=dev)
        ops.pack_([tensors[0], base[:5], tensors[2]], bucket, plan=plan)
        other = [tensors[0], base.view(F16)[:5], tensors[2]]
        other[1].copy_(torch.arange(5.0))
        ops.pack_(other, bucket, plan=plan)
        assert plan.state["table"] is not table
        _assert_bitwise(bucket, _expected(torch.zeros_like(bucket), other, offsets))


def test_bad_arguments(dev):
    t = _make([((4,), F32), ((3,), BF16)], dev)
    bucket = torch.zeros(16, device=dev)
    with pytest.raises(ValueError, match="offsets has 1 entries but tensors has 2"):
        ops.pack_(t, bucket, [0])
    with pytest.raises(ValueError, match="offsets must be non-negative"):
        ops.pack_(t, bucket, [-1, 8])
    with pytest.raises(TypeError, match="offsets must hold ints"):
        ops.pack_(t, bucket, [0.0, 8])
    with pytest.raises(ValueError, match=r"tensors\[1\] range \[14, 17\) ends past the bucket"):
        ops.pack_(t, bucket, [0, 14])
    overlap = r"ranges of tensors\[0\] \[0, 4\) and tensors\[1\] \[3, 6\) overlap"
    with pytest.raises(ValueError, match=overlap):
        ops.pack_(t, bucket, [0, 3])
    with pytest.raises(ValueError, match=r"tensors\[1\] is not contiguous"):
        ops.pack_([t[0], torch.zeros(3, 2, device=dev).t()], bucket, [0, 8])
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.int32"):
        ops.pack_([t[0], torch.zeros(3, dtype=torch.int32, device=dev)], bucket, [0, 8])
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a torch.Tensor or None"):
        ops.pack_([[1.0, 2.0], t[1]], bucket, [0, 8], numels=[2, 3])
    with pytest.raises(TypeError, match="wrap a single tensor in a list"):
        ops.pack_(t[0], bucket, [0])
    with pytest.raises(ValueError, match=r"tensors\[1\] is None: pass numels="):
        ops.pack_([t[0], None], bucket, [0, 8])
    with pytest.raises(ValueError, match=r"tensors\[0\] has 4 elements but numels\[0\] is 5"):
        ops.pack_(t, bucket, [0, 8], numels=[5, 3])
    with pytest.raises(ValueError, match=r"tensors\[0\] shares memory with bucket"):
        ops.pack_([bucket[:4], t[1]], bucket, [8, 12])
    with pytest.raises(ValueError, match="flat 1-D"):
        ops.pack_(t, bucket.view(4, 4), [0, 8])
    with pytest.raises(TypeError, match="bucket must have dtype float32, bfloat16, float16"):
        ops.pack_(t, bucket.double(), [0, 8])
    with pytest.raises(TypeError, match="scale must be a Python float or None"):
        ops.pack_(t, bucket, [0, 8], scale=torch.tensor(0.5))
    with pytest.raises(TypeError, match="accumulate must be True or False"):
        ops.pack_(t, bucket, [0, 8], accumulate=None)
    with pytest.raises(ValueError, match="pass offsets"):
        ops.pack_(t, bucket)
    shared = torch.zeros(6, device=dev)
    with pytest.raises(ValueError, match="unpack_ needs separate output tensors"):
        ops.unpack_(bucket, [shared[:4], shared[2:5]], [0, 8])
    ops.pack_([shared[:4], shared[2:5]], bucket, [0, 8])  # reading shared memory is fine
    if torch.cuda.is_available():
        other = "cpu" if dev == "cuda" else "cuda"
        with pytest.raises(ValueError, match=r"tensors\[1\] is on .* move them to one device"):
            ops.pack_([t[0], t[1].to(other)], bucket, [0, 8])


def test_empty_lists(dev):
    bucket = torch.full((4,), _SENTINEL, device=dev)
    ops.pack_([], bucket, [])
    ops.pack_([torch.zeros(0, device=dev)], bucket, [4])
    ops.unpack_(bucket, [], [])
    assert bool((bucket == _SENTINEL).all())


def test_pack_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The interpreter accepts kernels that Triton's compiler refuses: compile for an H100/H200
    (frontend, LLVM and ptxas from the triton wheel), every dtype branch in one kernel, in a
    process without TRITON_INTERPRET (it replaces the compiler's builders) and a fresh cache."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    stdout = run_sm90_script("_pack_sm90.py", tmp_path)
    assert "128-bit stores: yes" in stdout


@_TRITON
def test_recent_address_lists_are_not_uploaded_again(monkeypatch):
    """Backward's allocations often put a step's gradients back at addresses an earlier step used: the plan keeps
    the address vectors of its last few address lists and uploads only a list it has not seen recently; every
    call still reads through the addresses of the tensors it was given."""
    from fused_zero.kernels import pack as kpack
    dev = _triton_dev(monkeypatch)
    shapes = [((BLOCK + 3,), F32), ((5,), BF16), ((2, 4), F32)]
    lists = [_make(shapes, dev, seed=20 + k) for k in range(6)]  # all alive: six distinct address lists
    offsets, size = _layout(lists[0])
    bucket = torch.zeros(size, device=dev)
    plan = ops.pack_plan(lists[0], offsets, bucket)
    before = kpack.uploads
    for k in (0, 1, 0, 1, 2, 0):  # three lists in turn: uploaded once each
        ops.pack_checked_(plan, lists[k], bucket)
        _assert_bitwise(bucket, _expected(torch.zeros_like(bucket), lists[k], offsets))
    assert kpack.uploads - before == 3
    for k in (3, 4, 5, 0):  # 4 more lists: the least recently used vector (list 1, then 2) leaves
        ops.pack_checked_(plan, lists[k], bucket)
    assert kpack.uploads - before == 6  # (list 0 was used last before 3, 4, 5: still kept)
    for k in (1, 2):
        ops.pack_checked_(plan, lists[k], bucket)
        _assert_bitwise(bucket, _expected(torch.zeros_like(bucket), lists[k], offsets))
    assert kpack.uploads - before == 8
    none = [lists[0][0], None, lists[0][2]]  # an entry's None-ness changes the table: its vectors go with it
    ops.pack_checked_(plan, none, bucket)
    ops.pack_checked_(plan, lists[0], bucket)
    assert kpack.uploads - before == 10
