"""torch.profiler summary of one training step: where the host and the device spend it, and what it reads.

    python bench/profile_step.py [--stage 2] [--dtype bf16] [--device cuda] [--blocks 0]

One process, no process group: the example GPT (on CUDA the 219M one of bench_step.py's
cuda_world1 run, on CPU a small one) or, with ``--blocks N``, bench_host.py's N residual blocks
(many small parameters: the host-bound case), ShardedOptimizer at ``--stage`` against torch's
``AdamW(fused=True)``. After warm-up steps each optimizer's step (zero_grad, forward, backward,
step) runs once under the profiler; printed per optimizer: wall time of the profiled step, the
device-to-host reads fused_zero made (``host_read.counting``: each a sync on a GPU), the device
kernels launched, the packs' address uploads (gradients at addresses no recent step used), the
CUDA syncs (cudaStreamSynchronize / cudaDeviceSynchronize calls), and the top operators by self
time on the host and on the device. bench/gpu_checks.sh runs it on a lent GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

from fused_zero import ShardedOptimizer  # noqa: E402
from fused_zero.host_read import counting  # noqa: E402

HPARAMS = dict(lr=1e-4, weight_decay=0.1)


def build(args, which: str, device: torch.device):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.blocks:
        from bench_host import Blocks
        model = Blocks(args.blocks).to(device, dtype)
        batch = torch.randn(4, 64, device=device, dtype=dtype)

        def loss_of():
            return model(batch)
    else:
        big = device.type == "cuda"
        cfg = (GPTConfig(vocab=32768, d_model=1024, n_layer=12, n_head=16, seq_len=512, tie_weights=False) if big
               else GPTConfig(vocab=2048, d_model=256, n_layer=4, n_head=4, seq_len=64, tie_weights=False))
        model = GPT(cfg, seed=0).to(device, dtype)
        x, y = synthetic_batch(cfg, 8 if big else 4, step=0, device=device)

        def loss_of():
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "fp32"):
                return model(x, y)[1]
    if which == "torch":
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HPARAMS)
    else:
        opt = ShardedOptimizer(model if args.stage == 3 else model.parameters(), stage=args.stage, **HPARAMS)
    return model, opt, loss_of


def step(opt, loss_of) -> None:
    opt.zero_grad(set_to_none=True)
    loss_of().backward()
    opt.step()


def summarize(name: str, prof, wall_s: float, reads, device: torch.device, top: int) -> str:
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.device_type is not None and "cuda" in str(e.device_type).lower()
                   and e.key not in ("cudaLaunchKernel",))
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaEventSynchronize"))
    memcpy_dtoh = sum(e.count for e in events if "DtoH" in e.key or "Device -> Host" in e.key)
    lines = [f"== {name}: one step {wall_s * 1e3:.2f} ms wall; fused_zero device-to-host reads "
             f"{sum(reads.values())} {dict(reads)}"]
    if device.type == "cuda":
        lines.append(f"   device kernels launched {launches}; CUDA syncs {syncs}; DtoH copies {memcpy_dtoh}")
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=top))
    if device.type == "cuda":
        lines.append(events.table(sort_by="self_cuda_time_total", row_limit=top))
    return "\n".join(lines)


def python_time(name: str, opt, loss_of, steps: int, device: torch.device, top: int) -> str:
    """``steps`` steps timed plainly, then the same under cProfile: the functions by time of their own. CUDA's
    backward runs on autograd's device thread, which cProfile does not see: under cProfile backward runs on
    this thread (``set_multithreading_enabled(False)``), so the hooks' Python shows."""
    import cProfile
    import io
    import pstats

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(opt, loss_of)
    sync()
    plain = (time.perf_counter() - t0) / steps
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(steps):
            step(opt, loss_of)
        sync()
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    print("-- fused_zero's and Triton's functions by cumulative time (what each costs with its callees):", file=out)
    stats.sort_stats("cumulative").print_stats(r"fused_zero|kernels|triton", 2 * top)
    head = f"== {name}: {plain * 1e3:.2f} ms per step over {steps} steps (no profiler); cProfile, per {steps} steps:"
    return head + "\n" + "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def _address_uploads(device: torch.device) -> int | None:
    """The Triton packing kernels' address uploads so far (kernels/pack.py), None off CUDA."""
    if device.type != "cuda":
        return None
    from fused_zero.kernels import pack as kpack
    return kpack.uploads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=0, help="bench_host's residual blocks instead of the GPT")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                   help="also run STEPS steps of each optimizer under cProfile and print the Python functions "
                        "with the most time of their own (what the host spends outside torch's C++ ops)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for which in ("torch", "sharded"):
        model, opt, loss_of = build(args, which, device)
        for _ in range(args.warmup):
            step(opt, loss_of)
        if device.type == "cuda":
            torch.cuda.synchronize()
        uploads = _address_uploads(device)
        with counting() as reads, profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step(opt, loss_of)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        name = "torch AdamW(fused=True)" if which == "torch" else f"ShardedOptimizer stage {args.stage}"
        print(summarize(f"{name}, {args.dtype}, {device}", prof, wall, reads, device, args.top), flush=True)
        if uploads is not None:  # the packs' address vectors sent up in that step (new .grad addresses)
            print(f"   pack address uploads in the profiled step: {_address_uploads(device) - uploads}", flush=True)
        if args.cprofile:
            print(python_time(name, opt, loss_of, args.cprofile, device, args.top), flush=True)
        if hasattr(opt, "close"):
            opt.close()
        del model, opt
    return 0


if __name__ == "__main__":
    sys.exit(main())
