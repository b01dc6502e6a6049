"""One optimizer step, fp32 master + bf16 grad + bf16 param copy: fused_zero vs torch.

    python -m pytest bench/bench_adamw.py --benchmark-only      # add -s -v for the table

Sizes: 1e6, 1e7, 1e8 elements on CUDA; 1e5, 1e6 on CPU.
Variants:
  fused        fused_zero.ops.adamw_ with param_out (on CUDA the Triton kernel; on CPU
               its native backend, torch's fused CPU AdamW plus a cast: the Triton
               interpreter cannot be timed)
  twin         fused_zero.ops.adamw_twin.adamw_, the unfused torch twin
  torch_*      torch.optim.AdamW with foreach=False / foreach=True / fused=True, each
               followed by a separate fp32 -> bf16 cast pass of the params (what torch
               needs for bf16 params with an fp32 master). torch needs grads in the param
               dtype, so they get a ready fp32 grad (their true traffic is higher still).
  *_amsgrad    fused and torch_fused with amsgrad=True (a max_exp_avg_sq buffer more).
extra_info: bytes that must move for this work, 28 B/element for every variant (read p 4 +
g 2 + m 4 + v 4, write p 4 + m 4 + v 4 + p_out 2), 36 with amsgrad (read and write
max_exp_avg_sq 4 + 4), so GB/s is an effective rate comparable across variants; and its %
of the device's measured copy bandwidth (bench/_bandwidth.py).
"""
from __future__ import annotations

import pytest
import torch
from _bandwidth import device, measure

from fused_zero import ops
from fused_zero.ops import adamw_twin

CUDA = torch.cuda.is_available()
SIZES = [10**6, 10**7, 10**8] if CUDA else [10**5, 10**6]
BYTES_PER_ELEMENT = 4 + 2 + 4 + 4 + 4 + 4 + 4 + 2
AMSGRAD_BYTES = 4 + 4
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
VARIANTS = ["fused", "twin", "torch_forloop", "torch_foreach", "torch_fused", "fused_amsgrad",
            "torch_fused_amsgrad"]
_BACKEND = {"fused": "triton" if CUDA else "native: torch fused CPU AdamW", "twin": "torch twin"}


def _setup(n: int):
    gen = torch.Generator().manual_seed(0)
    dev = device()
    p = torch.randn(n, generator=gen).to(dev)
    g = (torch.randn(n, generator=gen) * 1e-2).to(dev, torch.bfloat16)
    m = torch.zeros(n, device=dev)
    v = torch.zeros(n, device=dev)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    return p, g, m, v, out


def _make_step(variant: str, n: int):
    p, g, m, v, out = _setup(n)
    amsgrad = variant.endswith("_amsgrad")
    variant = variant.removesuffix("_amsgrad")
    if variant in ("fused", "twin"):
        fn = ops.adamw_ if variant == "fused" else adamw_twin.adamw_
        extra = dict(amsgrad=True, max_exp_avg_sq=torch.zeros_like(v)) if amsgrad else {}

        def step():
            fn(p, g, m, v, step=10, param_out=out, **HYPER, **extra)

        return step, p, out

    param = torch.nn.Parameter(p)
    param.grad = g.float()
    flags = dict(torch_forloop=dict(foreach=False), torch_foreach=dict(foreach=True),
                 torch_fused=dict(fused=True))[variant]
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], amsgrad=amsgrad, **flags)

    def step():
        opt.step()
        with torch.no_grad():
            out.copy_(param)  # the separate cast pass to the bf16 params

    return step, param, out


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n:.0e}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_adamw_step(benchmark, variant, n):
    step, param, out = _make_step(variant, n)
    step()
    assert torch.equal(out, param.detach().to(torch.bfloat16))
    per_element = BYTES_PER_ELEMENT + (AMSGRAD_BYTES if variant.endswith("_amsgrad") else 0)
    base = variant.removesuffix("_amsgrad")
    measure(benchmark, step, bytes_moved=n * per_element, rounds=20 if CUDA else 5, variant=variant,
            numel=n, bytes_per_element=per_element, backend=_BACKEND.get(base, "torch"),
            amsgrad=variant.endswith("_amsgrad"))
