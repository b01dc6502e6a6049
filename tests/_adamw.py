"""Shared by the ops.adamw_ tests: states, gradients, torch.optim as the outside reference."""
from __future__ import annotations

import torch

from fused_zero import ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
STATE_NAMES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def random_state(n: int, seed: int = 0, amsgrad: bool = False):
    """param, exp_avg, exp_avg_sq (and max_exp_avg_sq) of a run already under way (v >= 0;
    the max above v in about half the places, below it elsewhere, to test both sides)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    state = [p, m, v]
    if amsgrad:
        state.append(v * torch.rand(n, generator=gen) * 2)
    return [t.to(DEVICE) for t in state]


def grads(n: int, steps: int, dtype=torch.float32, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(DEVICE, dtype) for _ in range(steps)]


class TorchAdam:
    """torch.optim.AdamW / Adam (foreach=False) from a given state: the outside reference."""

    def __init__(self, p, m, v, step, *, lr, beta1, beta2, eps, weight_decay,
                 adam_w_mode=True, maximize=False, vmax=None):
        self.param = torch.nn.Parameter(p.clone())
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        self.opt = cls([self.param], lr=lr, betas=(beta1, beta2), eps=eps,
                       weight_decay=weight_decay, maximize=maximize, foreach=False,
                       amsgrad=vmax is not None)
        self.opt.state[self.param] = {"step": torch.tensor(float(step)),
                                      "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        if vmax is not None:
            self.opt.state[self.param]["max_exp_avg_sq"] = vmax.clone()

    def step(self, g):
        self.param.grad = g.float()
        self.opt.step()
        st = self.opt.state[self.param]
        names = [n for n in STATE_NAMES[1:] if n in st]
        return (self.param.detach(), *(st[n] for n in names))


def assert_close_to_torch(ours, ref, tol=1e-6):
    assert len(ours) == len(ref)
    for name, a, b in zip(STATE_NAMES, ours, ref):
        err = rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def run_op(n, *, grad_dtype=torch.float32, seed=0, out_dtype=torch.bfloat16, **kw):
    """One call on a fresh random state; returns (param, exp_avg, exp_avg_sq, param_out),
    and max_exp_avg_sq last with amsgrad=True."""
    amsgrad = kw.get("amsgrad", False)
    p, m, v, *vmax = random_state(n, seed, amsgrad=amsgrad)
    out = torch.zeros(n, dtype=out_dtype, device=DEVICE)
    args = dict(HYPER, step=3)
    args.update(kw)
    if amsgrad:
        args["max_exp_avg_sq"] = vmax[0]
    g = args.pop("grad", None)
    if g is None:
        (g,) = grads(n, 1, grad_dtype, seed + 1)
    ops.adamw_(p, g, m, v, param_out=out, **args)
    return (p, m, v, out, *vmax)


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def twin_cases() -> dict:
    """Options under which the kernel and the twin are compared (fresh tensors per call)."""
    return dict(adamw=dict(grad_dtype=torch.bfloat16),
                adam_l2_maximize_fp16=dict(adam_w_mode=False, maximize=True,
                                           grad_dtype=torch.float16, out_dtype=torch.float16),
                tensors_scale=dict(lr=torch.tensor(2e-3, device=DEVICE),
                                   step=torch.tensor(5.0, device=DEVICE),
                                   grad_scale=torch.tensor(0.25, device=DEVICE)),
                lerp_large=dict(beta1=0.3, weight_decay=0.0, out_dtype=torch.float32))


def assert_kernel_matches_twin(monkeypatch, n: int, **kw) -> None:
    """run_op under FUSED_ZERO_BACKEND=triton and =torch: bitwise under the interpreter
    (the same fp32 ops, no fused multiply-adds), within 2e-6 on a GPU."""
    monkeypatch.setenv("FUSED_ZERO_BACKEND", "triton")
    kernel = run_op(n, **kw)
    monkeypatch.setenv("FUSED_ZERO_BACKEND", "torch")
    twin = run_op(n, **kw)
    if DEVICE.type == "cpu":
        assert_bitwise(kernel, twin)
    else:
        for a, b in zip(kernel, twin):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
