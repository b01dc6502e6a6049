"""fused_zero.ops.adamw_: the Triton kernel (interpreter on CPU) and its torch twin.

Each test runs under FUSED_ZERO_BACKEND=triton and =torch. Oracles: torch.optim.AdamW
/ Adam with foreach=False (relative error <= 1e-6), the op itself under pre-scaled
grads / number scalars (bitwise), and kernel vs twin (bitwise on CPU).
"""
from __future__ import annotations

import pytest
import torch
from _adamw import (DEVICE, HYPER, TorchAdam, assert_bitwise, assert_close_to_torch,
                    assert_kernel_matches_twin, grads, random_state, run_op, twin_cases)

from fused_zero import ops
from fused_zero.kernels.adamw import BLOCK
from fused_zero.ops import adamw_twin

SIZES = [1, BLOCK - 1, BLOCK + 1, 7919, 2**16 + 3]


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSED_ZERO_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("adam_w_mode, weight_decay, maximize",
                         [(True, 0.1, False), (False, 0.1, False), (True, 0.0, True)])
def test_100_steps_match_torch(backend, adam_w_mode, weight_decay, maximize):
    n, steps = 1000, 100
    p, m, v = (torch.zeros(n, device=DEVICE) for _ in range(3))
    p.copy_(torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE))
    hyper = dict(HYPER, weight_decay=weight_decay)
    ref = TorchAdam(p, m, v, 0, adam_w_mode=adam_w_mode, maximize=maximize, **hyper)
    for t, g in enumerate(grads(n, steps), start=1):
        ops.adamw_(p, g, m, v, step=t, adam_w_mode=adam_w_mode, maximize=maximize, **hyper)
        expected = ref.step(g)
    assert_close_to_torch((p, m, v), expected)


@pytest.mark.parametrize("n", SIZES)
def test_sizes_match_torch(backend, n):
    p, m, v = random_state(n)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    ref = TorchAdam(p, m, v, 4, **HYPER)
    for t, g in enumerate(grads(n, 2), start=5):
        ops.adamw_(p, g, m, v, step=t, param_out=out, **HYPER)
        expected = ref.step(g)
        assert torch.equal(out, p.to(torch.bfloat16))
    assert_close_to_torch((p, m, v), expected)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_and_out_dtypes(backend, grad_dtype, out_dtype):
    n = BLOCK + 1
    p, m, v = random_state(n)
    p.mul_(100)  # values where bf16/fp16 rounding ties and carries are frequent
    out = torch.full((n,), 7, dtype=out_dtype, device=DEVICE)
    ref = TorchAdam(p, m, v, 9, **HYPER)
    (g,) = grads(n, 1, grad_dtype)
    ops.adamw_(p, g, m, v, step=10, param_out=out, **HYPER)
    assert torch.equal(out, p.to(out_dtype))
    assert_close_to_torch((p, m, v), ref.step(g))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_param_out_rounds_ties_and_overflow_like_torch(backend, out_dtype):
    """lr=0, wd=0 keeps param as it is, so param_out shows the rounding of chosen values."""
    gen = torch.Generator().manual_seed(9)
    high = torch.randint(0, 0x7F7F, (BLOCK + 7,), generator=gen, dtype=torch.int32) << 16
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0x1000 << 3], dtype=torch.int32)
    bits = high | low.repeat(len(high) // len(low) + 1)[: len(high)]
    p = bits.view(torch.float32)
    p[::2] = -p[::2]
    p[:8] = torch.tensor([float("inf"), -float("inf"), 3.4028235e38, 65519.0, 65520.0, 1e-40,
                          -0.0, 5.96e-8])
    p = p.to(DEVICE)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    out = torch.zeros(len(p), dtype=out_dtype, device=DEVICE)
    before = p.clone()
    ops.adamw_(p, torch.randn(len(p)).to(DEVICE), m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999,
               eps=1e-8, weight_decay=0.0, param_out=out)
    assert torch.equal(p, before)  # numerically (-0.0 may become +0.0, as in torch)
    assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))


OPTIONS = {
    "no_weight_decay": dict(weight_decay=0.0),
    "adam_l2": dict(adam_w_mode=False),
    "adam_l2_maximize": dict(adam_w_mode=False, maximize=True),
    "maximize": dict(maximize=True),
    "lerp_large_weight": dict(beta1=0.3, beta2=0.5),  # torch.lerp's other branch
    "eps_zero_big_lr": dict(eps=0.0, lr=0.5),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_torch(backend, option):
    n = BLOCK + 1
    kw = dict(HYPER, **OPTIONS[option])
    flags = {k: kw.pop(k) for k in ("adam_w_mode", "maximize") if k in kw}
    p, m, v = random_state(n)
    ref = TorchAdam(p, m, v, 2, **kw, **flags)
    for t, g in enumerate(grads(n, 3), start=3):
        ops.adamw_(p, g, m, v, step=t, **kw, **flags)
        expected = ref.step(g)
    assert_close_to_torch((p, m, v), expected)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_grad_scale_equals_prescaled_grad(backend, grad_dtype, as_tensor):
    n, scale = BLOCK + 1, 0.37
    (g,) = grads(n, 1, grad_dtype)
    s = torch.tensor(scale, device=DEVICE) if as_tensor else scale
    scaled = run_op(n, grad=g, grad_scale=s)
    prescaled = run_op(n, grad=g.float() * scale)
    assert_bitwise(scaled, prescaled)
    assert not torch.equal(scaled[0], run_op(n, grad=g)[0])


@pytest.mark.parametrize("step", [1, 2, 10, 1000, 123457])
@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_tensor_lr_and_step_equal_number_path(backend, which, step):
    n = 257
    lr = torch.tensor(1e-3, dtype=torch.float64, device=DEVICE)
    kw = dict(step=step, lr=1e-3)
    if which in ("lr", "both"):
        kw["lr"] = lr
    if which in ("step", "both"):
        kw["step"] = torch.tensor(float(step), device=DEVICE)
    for adam_w_mode in (True, False):
        assert_bitwise(run_op(n, adam_w_mode=adam_w_mode, **kw),
                       run_op(n, adam_w_mode=adam_w_mode, step=step, lr=1e-3))


@pytest.mark.parametrize("step", [2**31 - 1, 2**31, 2**31 + 5, 2**32 + 1])
def test_tensor_lr_with_a_step_past_int32(backend, step):
    """A step number in [2**31, 2**32) reached Triton's interpreter as a uint32 read as a negative int64 (NaN at
    2**31); compiled kernels type it int64."""
    lr = torch.tensor(1e-3, dtype=torch.float64, device=DEVICE)
    assert_bitwise(run_op(33, step=step, lr=lr), run_op(33, step=step, lr=1e-3))


def test_fp32_lr_tensor_and_int_step_tensor(backend):
    lr = torch.tensor(3e-4, device=DEVICE)  # fp32: its value is what the number path gets
    step = torch.tensor(17, dtype=torch.int64, device=DEVICE)
    assert_bitwise(run_op(300, lr=lr, step=step), run_op(300, lr=lr.item(), step=17))


@pytest.mark.parametrize("grad_scale", [None, 0.5])
def test_found_inf(backend, grad_scale):
    n = BLOCK + 1
    p, m, v = random_state(n)
    (g,) = grads(n, 1)
    g[5] = float("inf")  # what made found_inf nonzero in the first place
    out = torch.full((n,), 3, dtype=torch.bfloat16, device=DEVICE)
    before = [t.clone() for t in (p, m, v, out, g)]
    found = torch.ones((), device=DEVICE)
    ops.adamw_(p, g, m, v, step=1, param_out=out, grad_scale=grad_scale, found_inf=found, **HYPER)
    assert_bitwise((p, m, v, out, g), before)

    found.zero_()
    (g,) = grads(n, 1)
    updated = run_op(n, grad=g, grad_scale=grad_scale, found_inf=found)
    assert_bitwise(updated, run_op(n, grad=g, grad_scale=grad_scale))
    assert not torch.equal(updated[0], random_state(n)[0])


def test_numel_zero_is_a_no_op(backend):
    e = torch.empty(0, device=DEVICE)
    ops.adamw_(e, e.clone(), e.clone(), e.clone(), step=1, **HYPER)


@pytest.mark.parametrize("n", [BLOCK + 1, 7919])
@pytest.mark.parametrize("case", ["adamw", "adam_l2_maximize_fp16", "tensors_scale", "lerp_large"])
def test_kernel_matches_twin(monkeypatch, n, case):
    assert_kernel_matches_twin(monkeypatch, n, **twin_cases()[case])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_capture_with_tensor_step(monkeypatch):
    monkeypatch.setenv("FUSED_ZERO_BACKEND", "triton")
    n = 3 * BLOCK + 5
    p, m, v = random_state(n)
    (g,) = grads(n, 1)
    step = torch.tensor(1.0, device=DEVICE)
    lr = torch.tensor(1e-3, device=DEVICE)
    ref = [t.clone() for t in (p, m, v)]
    ops.adamw_(p, g, m, v, step=step, lr=lr, **{k: HYPER[k] for k in HYPER if k != "lr"})  # warm up
    p.copy_(ref[0]), m.copy_(ref[1]), v.copy_(ref[2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.adamw_(p, g, m, v, step=step, lr=lr, **{k: HYPER[k] for k in HYPER if k != "lr"})
    for t in (1, 2, 3):
        step.fill_(t)
        graph.replay()
        ops.adamw_(*ref[:1], g, *ref[1:], step=t, lr=lr.item(),
                   **{k: HYPER[k] for k in HYPER if k != "lr"})
    torch.cuda.synchronize()
    assert_bitwise((p, m, v), ref)


# ---- argument checks -------------------------------------------------------------------

def good_args(n=10):
    p, m, v = (torch.zeros(n) for _ in range(3))
    return dict(param=p, grad=torch.zeros(n), exp_avg=m, exp_avg_sq=v, step=1, **HYPER)


BAD = [
    (dict(grad=torch.zeros(9)), ValueError, "grad has 9 elements but param has 10"),
    (dict(param_out=torch.zeros(11, dtype=torch.bfloat16)), ValueError, "param_out has 11"),
    (dict(param=torch.zeros(20)[::2]), ValueError, "param must be contiguous"),
    (dict(exp_avg=torch.zeros(2, 5)), ValueError, "exp_avg must be a flat 1-D buffer"),
    (dict(param=torch.zeros(10, dtype=torch.bfloat16)), TypeError, "param must have dtype float32"),
    (dict(exp_avg_sq=torch.zeros(10, dtype=torch.float64)), TypeError, "exp_avg_sq must have dtype"),
    (dict(grad=torch.zeros(10, dtype=torch.float64)), TypeError, "grad must have dtype float32, bfloat16"),
    (dict(param_out=torch.zeros(10, dtype=torch.int32)), TypeError, "param_out must have dtype"),
    (dict(grad=[0.0] * 10), TypeError, "grad must be a torch.Tensor"),
    (dict(grad=torch.zeros(10, device="meta")), ValueError, "grad is on meta but param is on cpu"),
    (dict(found_inf=torch.zeros((), device="meta")), ValueError, "found_inf is on meta"),
    (dict(lr=-1e-3), ValueError, r"lr must be >= 0"),
    (dict(lr=float("nan")), ValueError, r"lr must be >= 0"),
    (dict(lr=torch.tensor(1, dtype=torch.int32)), TypeError, "lr must have dtype float32, float64"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "lr must hold one element"),
    (dict(lr=torch.tensor(-1e-3)), ValueError, r"lr must be >= 0"),  # as the optimizer refuses it
    (dict(lr=torch.tensor(float("nan"), dtype=torch.float64)), ValueError, r"lr must be >= 0"),
    (dict(beta1=1.0), ValueError, r"beta1 must be in \[0.0, 1.0\)"),
    (dict(beta2=-0.1), ValueError, r"beta2 must be in \[0.0, 1.0\)"),
    (dict(beta1=torch.tensor(0.9)), TypeError, "beta1 must be a Python number"),
    (dict(eps=-1e-8), ValueError, "eps must be >= 0"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
    (dict(step=0), ValueError, r"step must be >= 1"),
    (dict(step=1.5), ValueError, "step must be a whole number"),
    (dict(step="1"), TypeError, "step must be an int or a 0-d tensor"),
    (dict(step=torch.tensor(True)), TypeError, "step must have dtype"),
    (dict(grad_scale=torch.tensor(1.0, dtype=torch.float16)), TypeError, "grad_scale must have dtype float32"),
    (dict(grad_scale="2"), TypeError, "grad_scale must be None, a number or a 0-d fp32 tensor"),
    (dict(found_inf=1.0), TypeError, "found_inf must be None or a 0-d fp32 tensor"),
    (dict(amsgrad=True), ValueError, "amsgrad=True needs max_exp_avg_sq"),
    (dict(max_exp_avg_sq=torch.zeros(10)), ValueError, "max_exp_avg_sq is only used with amsgrad=True"),
    (dict(amsgrad=1, max_exp_avg_sq=torch.zeros(10)), TypeError, "amsgrad must be True or False"),
    *((dict(amsgrad=True, max_exp_avg_sq=t), exc, f"max_exp_avg_sq {msg}") for t, exc, msg in [
        (torch.zeros(10, dtype=torch.bfloat16), TypeError, "must have dtype float32"),
        (torch.zeros(9), ValueError, "has 9 elements but param has 10"),
        (torch.zeros(2, 5), ValueError, "must be a flat 1-D buffer"),
        (torch.zeros(20)[::2], ValueError, "must be contiguous"),
        (torch.zeros(10, device="meta"), ValueError, "is on meta but param is on cpu"),
        ([0.0] * 10, TypeError, "must be a torch.Tensor")]),
]


@pytest.mark.parametrize("change, exc, match", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_arguments_raise(change, exc, match):
    args = good_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ops.adamw_(**args)


def test_overlapping_buffers_raise():
    buf = torch.zeros(20)
    args = good_args()
    args.update(param=buf[:10], exp_avg=buf[5:15])
    with pytest.raises(ValueError, match="param and exp_avg overlap in memory"):
        ops.adamw_(**args)
    args = good_args()
    out = args["param"].view(torch.bfloat16)[:10]
    with pytest.raises(ValueError, match="param and param_out overlap"):
        ops.adamw_(**args, param_out=out)
    for other in ("param", "grad", "exp_avg", "exp_avg_sq"):
        args = good_args()
        with pytest.raises(ValueError, match=f"{other} and max_exp_avg_sq overlap in memory"):
            ops.adamw_(**args, amsgrad=True, max_exp_avg_sq=args[other])


def test_twin_leaves_grad_untouched():
    p, m, v = random_state(100)
    (g,) = grads(100, 1)
    g0 = g.clone()
    adamw_twin.adamw_(p, g, m, v, step=1, grad_scale=2.0, maximize=True, adam_w_mode=False, **HYPER)
    assert torch.equal(g, g0)
