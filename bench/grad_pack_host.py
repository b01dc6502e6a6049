"""Host cost of the gradient packs of one step at world size 1, measurable without a GPU.

    python bench/grad_pack_host.py [steps]

The example GPT in bf16 (a small one, its buckets sized so that it has 14, as the 219M GPT of bench_step.py's
cuda_world1 run has), ShardedOptimizer at stages 2 and 1 with the Triton backend under TRITON_INTERPRET=1 and its
pack launch stubbed out (``_pack_kernel`` replaced): what is timed is everything a pack does on the host up to the
launch, which on a GPU host runs before (and, when longer, instead of) the copy; Triton's own launch and the CUDA
upload of the addresses are not in it (each pack pays them on a GPU). Each stage runs with the buckets packed one
by one and in direct runs (comm/direct_runs.py). Printed per variant, medians over the steps after two warm-up
steps: packs (launches) per step, microseconds spent inside ``ops.pack_checked_``, address uploads. Only the packs
run: the update is left out (step() is not called; the shards are consumed by ``end_step``).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FUSED_ZERO_BACKEND"] = "triton"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import torch  # noqa: E402
from _host_cost import LaunchStub  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import fused_zero.ops as fops  # noqa: E402
from fused_zero import ShardedOptimizer  # noqa: E402
from fused_zero.comm import grad_sync  # noqa: E402
from fused_zero.kernels import pack as kpack  # noqa: E402

BUCKETS = 14


def measure(stage: int, together: bool, steps: int) -> tuple[float, int, int]:
    """(host us inside the packs, packs, uploads) per step, medians over ``steps`` steps."""
    real_runs, real_pack = grad_sync.direct_runs, fops.pack_checked_
    if not together:
        grad_sync.direct_runs = lambda buckets, pipe, bounded: {}
    spent, calls = [0.0], [0]

    def timed(plan, tensors, bucket, **kw):
        t0 = time.perf_counter()
        out = real_pack(plan, tensors, bucket, **kw)
        spent[0] += time.perf_counter() - t0
        calls[0] += 1
        return out
    fops.pack_checked_ = timed
    try:
        cfg = GPTConfig(vocab=2048, d_model=256, n_layer=4, n_head=4, seq_len=64, tie_weights=False)
        model = GPT(cfg, seed=0).to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        opt = ShardedOptimizer(model.parameters(), stage=stage, lr=1e-4, bucket_numel=-(-n // BUCKETS // 64) * 64)
        x, y = synthetic_batch(cfg, 2, step=0)
        rows = []
        for s in range(steps + 2):
            spent[0], calls[0], uploads = 0.0, 0, kpack.uploads
            for p in model.parameters():
                p.grad = None
            model(x, y)[1].backward()
            if stage == 1:
                opt.grad_sync.prepare_step()  # stage 1 packs at step()
            opt.grad_sync.end_step()
            if s >= 2:
                rows.append((spent[0] * 1e6, calls[0], kpack.uploads - uploads))
        opt.close()
    finally:
        grad_sync.direct_runs, fops.pack_checked_ = real_runs, real_pack
    return (statistics.median(r[0] for r in rows), int(statistics.median(r[1] for r in rows)),
            int(statistics.median(r[2] for r in rows)))


def main(steps: int = 10) -> None:
    kpack._pack_kernel = LaunchStub()
    torch.set_num_threads(1)
    print(f"GPT in bf16, {BUCKETS} buckets, world size 1; per step (median of {steps}), the launch stubbed")
    for stage in (2, 1):
        for together in (False, True):
            us, packs, uploads = measure(stage, together, steps)
            how = "direct runs" if together else "one per bucket"
            print(f"  stage {stage}, {how:14s}: packs {packs:2d}, host in packs {us:7.1f} us, "
                  f"address uploads {uploads}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
