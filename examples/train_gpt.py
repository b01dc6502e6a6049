"""Train a small GPT with fused_zero.ShardedOptimizer: torch.optim.AdamW code, one line changed.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --stage 2
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --stage 1 --compare-ddp
    python examples/train_gpt.py                       # one process, world size 1

CPU ranks talk over gloo; with CUDA present the same command uses NCCL, one GPU per rank
(from LOCAL_RANK), and ShardedOptimizer runs its Triton kernels on the CUDA tensors.
The data is a synthetic Markov chain (examples/gpt.py), so the loss falls from ln(vocab)
towards the chain's entropy rate, printed as the floor.

Compared with torch's data-parallel recipe, ShardedOptimizer averages gradients itself:
the model is not wrapped in DistributedDataParallel, and gradient accumulation uses
``optimizer.no_sync()`` where DDP would use ``model.no_sync()``. ``--compare-ddp`` also
trains DDP + torch.optim.AdamW from the same init on the same data and reports the
largest relative difference of the per-step losses (exit 1 past --compare-tol).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, add_model_args, lr_lambda, markov_entropy, model_config, synthetic_batch  # noqa: E402

from fused_zero import ShardedOptimizer  # noqa: E402
from fused_zero.plan import estimate  # noqa: E402

MiB = 1 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0 disables clipping")
    p.add_argument("--bucket-numel", type=int, default=1 << 24)
    p.add_argument("--lr", type=float, default=3e-3, help="peak lr (warmup, then cosine)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default steps/10)")
    add_model_args(p)
    p.add_argument("--untie", action="store_true", help="untie the lm head from the embedding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param-comm", default=None, choices=("int8",), help="stage 3: quantized gathers (qwZ)")
    p.add_argument("--grad-comm", default=None, choices=("int8", "int4"), help="quantized reductions (qgZ)")
    p.add_argument("--compare-ddp", action="store_true",
                   help="also train DDP + torch AdamW on the same data and compare losses")
    p.add_argument("--compare-tol", type=float, default=None,
                   help="max relative loss difference accepted by --compare-ddp (default 1e-3 "
                        "for fp32; bf16 only reports, since torch AdamW keeps no fp32 master)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.grad_accum < 1:
        p.error("--steps and --grad-accum must be >= 1")
    return args


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device). Without torchrun's env, one process and no group."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def torch_memory_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The memory_bytes() split for torch AdamW (every rank holds everything)."""
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)
    params = list(model.parameters())
    state = [optimizer.state.get(p, {}) for p in params]
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params), "master": 0,
            "exp_avg": nbytes(s.get("exp_avg") for s in state),
            "exp_avg_sq": nbytes(s.get("exp_avg_sq") for s in state), "buffers": 0}


def fmt_memory(mem: dict) -> str:
    split = " ".join(f"{k} {v / MiB:.2f}" for k, v in mem.items())
    return f"mem/rank {sum(mem.values()) / MiB:.2f} MiB ({split})"


def print_planned_vs_measured(args, cfg: GPTConfig, world: int, mem: dict) -> None:
    """What ``python -m fused_zero.plan`` predicts for this run next to memory_bytes() after step 1."""
    with torch.device("meta"):  # shapes only, no memory
        meta = GPT(cfg)
    plan = estimate(model=meta, world_size=world, param_dtype=args.dtype,
                    bucket_numel=args.bucket_numel).stage(args.stage)
    rows = {"params": (plan.params, mem["params"]), "grads": (plan.grads, mem["grads"]),
            "optimizer": (plan.optimizer, mem["master"] + mem["exp_avg"] + mem["exp_avg_sq"]),
            "buffers": (plan.buffers, mem["buffers"])}
    rows["total"] = tuple(sum(r[i] for r in rows.values()) for i in (0, 1))
    print(f"stage {args.stage} memory per rank, MiB  planned   measured", flush=True)
    for name, (planned, measured) in rows.items():
        print(f"  {name:<30} {planned / MiB:9.2f} {measured / MiB:10.2f}", flush=True)


def train(args, cfg: GPTConfig, variant: str, rank: int, world: int, device) -> dict:
    """Train ``args.steps`` steps; ``variant`` is "sharded" or "ddp". Returns the history."""
    model = GPT(cfg, seed=args.seed).to(device=device, dtype=DTYPES[args.dtype])
    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else None
    clip = None
    if variant == "ddp":
        if dist.is_initialized():
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True)  # grads are the buckets: memory counted once
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)  # noqa: E501
        if max_norm is not None:
            clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # noqa: E731
        no_sync = model.no_sync if isinstance(model, DDP) else contextlib.nullcontext
    else:
        # optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)  # before  # noqa: E501
        optimizer = ShardedOptimizer(model if args.stage == 3 else model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,  # after: THE ONE CHANGED LINE  # noqa: E501
                                     stage=args.stage, max_grad_norm=max_norm, bucket_numel=args.bucket_numel,
                                     param_comm=args.param_comm, grad_comm=args.grad_comm)
        no_sync = optimizer.no_sync  # instead of DDP's model.no_sync(); clipping is fused into step()
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup, args.steps))

    tokens_per_step = args.batch_size * cfg.seq_len * args.grad_accum * world
    hist = {"loss": [], "tok_s": [], "mem": None, "comm": None}
    for step in range(args.steps):
        batches = [synthetic_batch(cfg, args.batch_size, step=step * args.grad_accum + i,
                                   rank=rank, seed=args.seed, device=device)
                   for i in range(args.grad_accum)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        loss_sum = torch.zeros((), device=device)
        for i, (x, y) in enumerate(batches):
            ctx = no_sync() if i < args.grad_accum - 1 else contextlib.nullcontext()
            with ctx:
                _, loss = model(x, y)
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach()
        if clip is not None:
            clip()
        optimizer.step()
        scheduler.step()
        mem = (optimizer.memory_bytes() if variant == "sharded"  # before zero_grad: grads count
               else torch_memory_bytes(model, optimizer))
        optimizer.zero_grad(set_to_none=True)
        loss_mean = loss_sum / (args.grad_accum * world)
        if world > 1:
            dist.all_reduce(loss_mean)
        loss_val = loss_mean.item()  # also waits for the device
        dt = time.perf_counter() - t0
        hist["loss"].append(loss_val)
        hist["tok_s"].append(tokens_per_step / dt)
        hist["mem"] = mem
        if variant == "sharded" and step == 0 and rank == 0:
            print_planned_vs_measured(args, cfg, world, mem)
        if variant == "sharded":
            hist["comm"] = optimizer.comm_bytes()
        if rank == 0:  # the memory split once (it does not change), then one short line a step
            print(f"[{variant}] step {step + 1:4d}/{args.steps} loss {loss_val:.4f} lr {lr:.2e} "
                  f"tok/s {tokens_per_step / dt:9.0f}" + (f" {fmt_memory(mem)}" if step == 0 else ""), flush=True)
    return hist


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    cfg = model_config(args, tie_weights=not args.untie)
    if rank == 0:
        n = GPT(cfg).num_params()
        backend = dist.get_backend() if dist.is_initialized() else "none"
        print(f"GPT {cfg}: {n / 1e6:.2f}M params, {args.dtype}; world {world} ({backend}, "
              f"{device.type}); ShardedOptimizer stage {args.stage}", flush=True)
    t_start = time.perf_counter()
    hist = train(args, cfg, "sharded", rank, world, device)
    wall = time.perf_counter() - t_start
    ref = train(args, cfg, "ddp", rank, world, device) if args.compare_ddp else None

    status = 0
    if rank == 0:
        losses, tail = hist["loss"], hist["loss"][-5:]
        steady = sorted(hist["tok_s"][min(2, len(hist["tok_s"]) - 1):])
        print(f"\nsummary: stage {args.stage}, world {world}, {args.steps} steps in {wall:.1f} s")
        print(f"  loss {losses[0]:.4f} -> {sum(tail) / len(tail):.4f} (mean of last {len(tail)});"
              f" floor ~{markov_entropy(cfg.vocab, args.seed):.4f}, ln(vocab) {math.log(cfg.vocab):.4f}")
        print(f"  median tokens/s {steady[len(steady) // 2]:.0f} (all ranks)")
        print(f"  ShardedOptimizer {fmt_memory(hist['mem'])}")
        if hist["comm"]:
            print("  comm/step/rank " + " ".join(f"{k} {v / MiB:.2f} MiB" for k, v in hist["comm"].items()))
        if ref is not None:
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["loss"]))
            tol = args.compare_tol if args.compare_tol is not None else (
                1e-3 if args.dtype == "fp32" else None)
            print(f"  DDP+AdamW        {fmt_memory(ref['mem'])}")
            print(f"  DDP+AdamW loss {ref['loss'][0]:.4f} -> {sum(ref['loss'][-5:]) / len(tail):.4f}; "
                  f"max relative loss difference vs ShardedOptimizer: {rel:.3e}"
                  + (f" (tolerance {tol:g}: {'OK' if rel <= tol else 'MISMATCH'})" if tol else ""))
            if tol is not None and rel > tol:
                status = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
