"""The default CPU backend of ops.adamw_ (torch's fused CPU AdamW) against torch.optim."""
import pytest
import torch

from fused_zero import ops


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    monkeypatch.delenv("FUSED_ZERO_BACKEND", raising=False)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("n", [1, 2047, 65539])
def test_matches_torch_optim_over_100_steps(adam_w_mode, maximize, n):
    torch.manual_seed(n)
    ref_p = torch.nn.Parameter(torch.randn(n))
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls([ref_p], lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, maximize=maximize, foreach=False)
    p, m, v = ref_p.detach().clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 101):
        g = torch.randn(n)
        ref_p.grad = g.clone()
        ref.step()
        ops.adamw_(p, g, m, v, step=step, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.05,
                   adam_w_mode=adam_w_mode, maximize=maximize)
    state = ref.state[ref_p]
    assert rel(p, ref_p) <= 1e-6
    assert rel(m, state["exp_avg"]) <= 1e-6
    assert rel(v, state["exp_avg_sq"]) <= 1e-6


def test_options_match_the_twin():
    torch.manual_seed(0)
    n = 4099
    g = torch.randn(n).bfloat16()
    outs = []
    for backend in (None, "torch"):
        with pytest.MonkeyPatch.context() as mp:
            if backend:
                mp.setenv("FUSED_ZERO_BACKEND", backend)
            torch.manual_seed(1)
            p, m, v = torch.randn(n), torch.rand(n), torch.rand(n)
            out = torch.empty(n, dtype=torch.bfloat16)
            ops.adamw_(p, g, m, v, step=torch.tensor(7.0), lr=torch.tensor(1e-3), beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.1, param_out=out, grad_scale=torch.tensor(0.25))
            outs.append((p, m, v, out))
    (p, m, v, out), (tp, tm, tv, tout) = outs
    assert rel(p, tp) <= 1e-6 and rel(m, tm) <= 1e-6 and rel(v, tv) <= 1e-6
    assert torch.equal(out, p.bfloat16())  # param_out is the new param rounded by torch


def test_found_inf_leaves_everything_unchanged():
    torch.manual_seed(0)
    p, g, m, v = torch.randn(100), torch.randn(100), torch.rand(100), torch.rand(100)
    out = torch.randn(100).bfloat16()
    before = [t.clone() for t in (p, m, v, out)]
    ops.adamw_(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
               param_out=out, found_inf=torch.tensor(1.0))
    for a, b in zip((p, m, v, out), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("grad_scale", [0.25, torch.tensor(0.25)], ids=["number", "tensor"])
def test_grad_is_read_only_and_scale_multiplies(grad_scale, amsgrad):
    """torch's fused CPU AdamW unscales an fp32 grad in place: the op must not let it."""
    torch.manual_seed(0)
    g = torch.randn(1000)
    g0 = g.clone()
    results = []
    for grad, scale in ((g, grad_scale), (g0 * 0.25, None)):
        torch.manual_seed(1)
        state = [torch.randn(1000), torch.rand(1000), torch.rand(1000)]
        vmax = torch.rand(1000) if amsgrad else None
        ops.adamw_(*state[:1], grad, *state[1:], step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.1, grad_scale=scale, amsgrad=amsgrad, max_exp_avg_sq=vmax)
        results.append(state + ([vmax] if amsgrad else []))
    assert torch.equal(g, g0)
    for a, b in zip(*results):
        assert torch.equal(a, b)  # grad_scale multiplies, bitwise as a pre-scaled grad
