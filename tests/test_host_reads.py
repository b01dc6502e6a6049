"""Device-to-host reads: all go through fused_zero.host_read, and a training step makes the ones it names.

On CUDA a read of a device tensor's values waits for the device; here on CPU the same call
sites are counted (host_read.counting) so that what a GPU step would sync on is known from
a CPU run. Steps 2-10 at each stage, 2 gloo ranks, with accumulation under ``no_sync()``:
with ``max_grad_norm`` one read of the step's stats; with a ``torch.amp.GradScaler`` and
``optimizer.clip_grad_norm_`` one more for the clip's own all-reduce and one for the overflow
verdict; nothing per parameter, per bucket or per micro-batch.
"""
import ast
import pathlib

import pytest
import torch

import fused_zero
from _dist import run_ranks
from _models import HYPER, TinyNet, batch, flags, loss_fn

#: the calls that read a tensor's values on the host (or copy it there)
READS = {"item", "tolist", "cpu"}


def test_every_read_goes_through_host_read_or_is_marked_a_host_tensor():
    root = pathlib.Path(fused_zero.__file__).parent
    unmarked = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "host_read.py":
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in READS \
                    and not node.args and "# host tensor" not in lines[node.lineno - 1]:
                unmarked.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not unmarked, "device reads outside fused_zero.host_read:\n" + "\n".join(unmarked)


def _reads(rank, world_size, stage, amp):
    from fused_zero import ShardedOptimizer
    from fused_zero.host_read import counting

    model = TinyNet()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), **HYPER, stage=stage, bucket_numel=1000,
                           max_grad_norm=None if amp else 0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, enabled=amp)
    per_step = []
    for t in range(10):
        with counting() as counts:
            opt.zero_grad()
            for micro in range(2):  # accumulation: the first micro-batch does not reduce
                x, y = batch(2 * t + micro, rank)
                with opt.no_sync() if micro == 0 else torch.enable_grad():
                    scaler.scale(loss_fn(model(x, **flags(t, rank)), y)).backward()
            if amp:
                scaler.unscale_(opt)
                opt.clip_grad_norm_(0.05)
            scaler.step(opt)
            scaler.update()
        per_step.append(dict(counts))
    return per_step


@pytest.mark.parametrize("amp", [False, True], ids=["clip", "scaler_and_clip"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_reads_its_stats_once(stage, amp):
    # clip_grad_norm_ makes its own stats all-reduce (and read) before step()'s
    want = {"step stats": 2, "overflow verdict": 1} if amp else {"step stats": 1}
    for per_step in run_ranks(_reads, 2, stage, amp, timeout=180):
        assert per_step[1:] == [want] * 9, per_step
