"""Device-to-host reads: all go through fused_zero.host_read, and a training step makes none.

On CUDA a read of a device tensor's values waits for the device; here on CPU the same call
sites are counted (host_read.counting) so that what a GPU step would sync on is known from
a CPU run. Steps 2-10 at each stage, 2 gloo ranks, with accumulation under ``no_sync()``,
with ``max_grad_norm`` or with a ``torch.amp.GradScaler`` and ``optimizer.clip_grad_norm_``:
no read at all. The exceptions, by design: a step in which this rank saw some parameter
without a gradient reads the has-grad flags once (it cannot know otherwise whether another
rank saw one), and a step that gives a parameter its first state reads the skip verdict once
(a step a GradScaler skips creates no state, as in torch).
"""
import ast
import contextlib
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


def _step(model, opt, scaler, batches, uses, amp):
    """One training step: two micro-batches (the first under no_sync()), the AMP recipe with clipping."""
    opt.zero_grad()
    for micro, (x, y) in enumerate(batches):  # accumulation: the first micro-batch does not reduce
        with opt.no_sync() if micro == 0 else torch.enable_grad():
            scaler.scale(loss_fn(model(x, **uses), y)).backward()
    if amp:
        scaler.unscale_(opt)
        opt.clip_grad_norm_(0.05)
    scaler.step(opt)
    scaler.update()


def _reads(rank, world_size, stage, amp, unused):
    from fused_zero import ShardedOptimizer
    from fused_zero.host_read import counting

    model = TinyNet()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), **HYPER, stage=stage, bucket_numel=1000,
                           max_grad_norm=None if amp else 0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, enabled=amp)
    per_step = []
    for t in range(10):
        uses = flags(t, rank) if unused else {"use_branch": True, "use_side": True}
        with counting() as counts:
            _step(model, opt, scaler, [batch(2 * t + micro, rank) for micro in range(2)], uses, amp)
        per_step.append(dict(counts))
    return per_step


@pytest.mark.parametrize("amp", [False, True], ids=["clip", "scaler_and_clip"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_reads_nothing(stage, amp):
    for per_step in run_ranks(_reads, 2, stage, amp, False, timeout=180):
        assert per_step[1:] == [{}] * 9, per_step


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rank_that_missed_a_gradient_reads_the_flags_once(stage):
    # flags(): "branch" is unused on even steps on every rank, "side" on rank 1 every third step
    for rank, per_step in enumerate(run_ranks(_reads, 2, stage, True, True, timeout=180)):
        missed = [t % 2 == 0 or (rank == 1 and t % 3 == 0) for t in range(10)]
        want = [{"has-grad flags": 1} if m else {} for m in missed]
        # step 2 gives "branch" its first state: under a GradScaler the skip verdict is read first, once
        want[1] = {**want[1], "verdict before new states": 1}
        assert per_step[1:] == want[1:], (rank, per_step)


@contextlib.contextmanager
def _syncs_raise():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _sync_free_steps(stage, amp):
    from fused_zero import ShardedOptimizer

    torch.manual_seed(0)
    model = TinyNet().cuda()
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), **HYPER, stage=stage, bucket_numel=1000,
                           max_grad_norm=None if amp else 0.05)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, enabled=amp)
    uses = {"use_branch": True, "use_side": True}
    xs = [batch(t, 0) for t in range(20)]
    xs = [(x.cuda(), y.cuda()) for x, y in xs]
    for t in range(10):
        with _syncs_raise() if t > 0 else contextlib.nullcontext():
            _step(model, opt, scaler, xs[2 * t: 2 * t + 2], uses, amp)
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("amp", [False, True], ids=["clip", "scaler_and_clip"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_steps_never_sync(stage, amp):
    """Steps 2-10 under torch.cuda.set_sync_debug_mode("error"): any host sync in them raises."""
    _sync_free_steps(stage, amp)
