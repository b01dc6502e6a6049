"""The step's phases show in a user's torch.profiler trace, and the labels cost nothing when none records."""
import pytest
import torch
from torch import nn

from fused_zero import ShardedOptimizer
from fused_zero.profiling import _OFF, label

PHASES = {"fused_zero::pack", "fused_zero::reduce_scatter", "fused_zero::update", "fused_zero::all_gather"}


def _traced_step(stage: int) -> set[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    opt = ShardedOptimizer(model, stage=stage) if stage == 3 else ShardedOptimizer(model.parameters(), stage=stage)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()  # a first step outside the trace: recording settles
    opt.step()
    opt.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        model(x)  # stage 3 gathers at the next forward
    opt.close()
    return {e.name for e in prof.events() if e.name.startswith("fused_zero::")}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_trace_shows_pack_reduce_scatter_update_and_all_gather(stage):
    assert _traced_step(stage) == PHASES


def test_no_profiler_no_label():
    assert label("fused_zero::pack") is _OFF  # a shared no-op context: nothing made per call
    with label("fused_zero::pack"):
        pass
