"""ops.adamw_(amsgrad=True, max_exp_avg_sq=...) on every backend: triton (the interpreter on
CPU), torch (the twin) and native (torch's fused CPU AdamW, the default on CPU).

Oracles: torch.optim.AdamW / Adam(amsgrad=True, foreach=False) over several steps (relative
error <= 1e-6, as in test_adamw.py), the op itself (pre-scaled grads, skipped steps), and
kernel vs twin (bitwise on CPU).
"""
from __future__ import annotations

import pytest
import torch
from _adamw import (DEVICE, HYPER, TorchAdam, assert_bitwise, assert_close_to_torch,
                    assert_kernel_matches_twin, grads, random_state, run_op, twin_cases)

from fused_zero import ops

_BACKENDS = ["triton", "torch"] + (["native"] if DEVICE.type == "cpu" else [])
SIZES = [1, 63, 1000, 4097]


@pytest.fixture(params=_BACKENDS)
def backend(request, monkeypatch):
    if request.param == "native":
        monkeypatch.delenv("FUSED_ZERO_BACKEND", raising=False)  # the CPU default
    else:
        monkeypatch.setenv("FUSED_ZERO_BACKEND", request.param)
    return request.param


def mixed_grads(n: int, steps: int, dtype=torch.float32, seed: int = 1):
    """Gradients whose magnitude jumps between 1 and 0.01 per element and step, so that
    exp_avg_sq falls below its running maximum in many places."""
    gen = torch.Generator().manual_seed(seed + 100)
    scales = [torch.where(torch.rand(n, generator=gen) < 0.5, 1.0, 0.01).to(DEVICE) for _ in range(steps)]
    return [(g.float() * s).to(dtype) for g, s in zip(grads(n, steps, seed=seed), scales)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adam_w_mode, maximize", [(True, False), (False, False), (True, True)])
def test_steps_from_zero_match_torch(backend, adam_w_mode, maximize, n):
    p = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    m, v, vmax = (torch.zeros(n, device=DEVICE) for _ in range(3))
    hyper = dict(HYPER, beta2=0.99)
    ref = TorchAdam(p, m, v, 0, adam_w_mode=adam_w_mode, maximize=maximize, vmax=vmax, **hyper)
    for t, g in enumerate(mixed_grads(n, 8), start=1):
        ops.adamw_(p, g, m, v, step=t, adam_w_mode=adam_w_mode, maximize=maximize, amsgrad=True,
                   max_exp_avg_sq=vmax, **hyper)
        expected = ref.step(g)
    assert_close_to_torch((p, m, v, vmax), expected)
    if n > 1:
        assert bool((vmax > v).any()), "the maximum never differed from exp_avg_sq: a weak test"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_under_way_dtypes_match_torch(backend, grad_dtype, out_dtype):
    n = 4097
    p, m, v, vmax = random_state(n, amsgrad=True)
    out = torch.full((n,), 7, dtype=out_dtype, device=DEVICE)
    ref = TorchAdam(p, m, v, 9, vmax=vmax, **HYPER)
    for t, g in enumerate(mixed_grads(n, 3, grad_dtype), start=10):
        ops.adamw_(p, g, m, v, step=t, param_out=out, amsgrad=True, max_exp_avg_sq=vmax, **HYPER)
        expected = ref.step(g)
        assert torch.equal(out, p.to(out_dtype))
    assert_close_to_torch((p, m, v, vmax), expected)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_grad_scale_equals_prescaled_grad(backend, grad_dtype, as_tensor):
    n, scale = 1000, 0.37
    (g,) = grads(n, 1, grad_dtype)
    s = torch.tensor(scale, device=DEVICE) if as_tensor else scale
    scaled = run_op(n, grad=g, grad_scale=s, amsgrad=True)
    prescaled = run_op(n, grad=g.float() * scale, amsgrad=True)
    assert_bitwise(scaled, prescaled)
    assert not torch.equal(scaled[0], run_op(n, grad=g, amsgrad=True)[0])


@pytest.mark.parametrize("grad_scale", [None, 0.5])
def test_found_inf_skips_and_keeps_the_maximum(backend, grad_scale):
    n = 1000
    p, m, v, vmax = random_state(n, amsgrad=True)
    (g,) = grads(n, 1)
    g[5] = float("inf")
    out = torch.full((n,), 3, dtype=torch.bfloat16, device=DEVICE)
    before = [t.clone() for t in (p, m, v, vmax, out, g)]
    found = torch.ones((), device=DEVICE)
    ops.adamw_(p, g, m, v, step=1, param_out=out, grad_scale=grad_scale, found_inf=found, amsgrad=True,
               max_exp_avg_sq=vmax, **HYPER)
    assert_bitwise((p, m, v, vmax, out, g), before)

    found.zero_()
    (g,) = grads(n, 1)
    updated = run_op(n, grad=g, grad_scale=grad_scale, found_inf=found, amsgrad=True)
    assert_bitwise(updated, run_op(n, grad=g, grad_scale=grad_scale, amsgrad=True))
    assert not torch.equal(updated[-1], random_state(n, amsgrad=True)[-1])


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)  # native: test_adamw_native
@pytest.mark.parametrize("which", ["lr", "step", "both"])
def test_tensor_lr_and_step_equal_number_path(backend, which):
    kw = dict(step=7, lr=1e-3)
    if which in ("lr", "both"):
        kw["lr"] = torch.tensor(1e-3, dtype=torch.float64, device=DEVICE)
    if which in ("step", "both"):
        kw["step"] = torch.tensor(7.0, device=DEVICE)
    for adam_w_mode in (True, False):
        assert_bitwise(run_op(257, adam_w_mode=adam_w_mode, amsgrad=True, **kw),
                       run_op(257, adam_w_mode=adam_w_mode, amsgrad=True, step=7, lr=1e-3))


@pytest.mark.parametrize("case", ["adamw", "adam_l2_maximize_fp16", "tensors_scale", "lerp_large",
                                  "found_inf_zero"])
@pytest.mark.parametrize("n", [4097, 63])
def test_kernel_matches_twin(monkeypatch, n, case):
    cases = twin_cases()
    cases["found_inf_zero"] = dict(cases["tensors_scale"], found_inf=torch.zeros((), device=DEVICE))
    assert_kernel_matches_twin(monkeypatch, n, amsgrad=True, **cases[case])


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_nan_propagates_into_the_maximum_as_torch_maximum(backend):
    """A NaN in exp_avg_sq or in max_exp_avg_sq makes the maximum NaN, as in
    torch.optim.AdamW(foreach=False). (torch's fused CPU AdamW, the native backend,
    keeps the old maximum where the new exp_avg_sq is NaN.)"""
    n = 100
    p, m, v, vmax = random_state(n, amsgrad=True)
    v[3], vmax[5] = float("nan"), float("nan")
    ref = TorchAdam(p, m, v, 2, vmax=vmax, **HYPER)
    (g,) = grads(n, 1)
    ops.adamw_(p, g, m, v, step=3, amsgrad=True, max_exp_avg_sq=vmax, **HYPER)
    for ours, want in zip((p, m, v, vmax), ref.step(g)):
        torch.testing.assert_close(ours, want, rtol=1e-6, atol=0, equal_nan=True)
    assert torch.isnan(vmax).nonzero().flatten().tolist() == [3, 5]


def test_numel_zero_is_a_no_op(backend):
    e = torch.empty(0, device=DEVICE)
    ops.adamw_(e, e.clone(), e.clone(), e.clone(), step=1, amsgrad=True, max_exp_avg_sq=e.clone(), **HYPER)
