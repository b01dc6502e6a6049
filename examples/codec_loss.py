"""Loss with quantized communication (ZeRO++'s qwZ and qgZ) against full precision, on the example GPT.

    torchrun --standalone --nproc_per_node=2 examples/codec_loss.py --steps 200 \
        --json bench/results/codec_loss.json --plot docs/codec_loss.png

Trains the same GPT (by default the benchmarks' 33.7M one: d 512, 8 layers, vocab 8192, untied head,
seq 128) from the same initial values on the same batches once per variant, ZeRO stage 3:
full precision, ``param_comm="int8"`` (the all-gathers), ``grad_comm="int8"`` and ``grad_comm="int4"``
(the gradient reduction). Each variant's final loss is the mean of its last ``--tail`` steps.

A single run cannot tell a codec's effect from the run's own spread: any perturbation of the weights
early on (a codec's rounding, but also a different reduction order) moves the whole later curve; on
this model single runs of the codecs landed 2-3% either side of full precision at step 200. ``--seeds 0 1 2 ...`` therefore trains every
variant from each seed's initial values (the batches stay the same), pairs each codec run with the
full-precision run of the same seed, and judges the mean of those paired differences; the script
prints every seed's difference, their mean and its standard error, and exits 1 when the mean is past
``--tol`` (default 1%). ``--json`` keeps every step's loss and each variant's ``comm_bytes()``; ``--plot``
draws the four curves in one picture (needs matplotlib: ``pip install -e '.[plot]'``), and
``--plot-from A.json B.json --plot out.png`` draws earlier runs side by side without training.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, lr_lambda, markov_entropy, synthetic_batch  # noqa: E402
from train_gpt import DTYPES, setup_distributed  # noqa: E402

from fused_zero import ShardedOptimizer  # noqa: E402

#: name -> the ShardedOptimizer options that differ from full precision
VARIANTS = {"full precision": {}, 'param_comm="int8"': {"param_comm": "int8"},
            'grad_comm="int8"': {"grad_comm": "int8"}, 'grad_comm="int4"': {"grad_comm": "int4"}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="the parameters' dtype (bf16: the optimizer keeps an fp32 master)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak lr (warm-up of steps/10, then cosine)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--quant-block", type=int, default=None, help="values per fp32 scale (default: ZeroConfig's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="SEED",
                   help="initial-value seeds; each variant trains once per seed and is judged on the mean "
                        "of its differences from full precision at the same seed")
    p.add_argument("--until", type=int, default=None, metavar="N",
                   help="train only the first N steps of the --steps schedule (a quick look at early training)")
    p.add_argument("--tail", type=int, default=10, help="steps averaged for the final loss")
    p.add_argument("--tol", type=float, default=0.01, help="largest relative final-loss difference accepted")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME")
    p.add_argument("--json", default=None, help="write every step's loss and the comm bytes here")
    p.add_argument("--plot", default=None, help="draw the loss curves into this PNG")
    p.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                   help="train nothing: draw --plot from these --json files, one panel each")
    args = p.parse_args(argv)
    if args.steps < 1 or not 0 < args.tail <= args.steps:
        p.error("--steps must be >= 1 and --tail in [1, steps]")
    if args.until is not None and not args.tail <= args.until <= args.steps:
        p.error("--until must be in [--tail, --steps]")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error("--seeds must be distinct and >= 0")
    if args.plot_from and not args.plot:
        p.error("--plot-from needs --plot (the picture to write)")
    return args


def train(args, cfg: GPTConfig, options: dict, rank: int, world: int, device, seed: int = 0) -> dict:
    """``args.steps`` steps of ZeRO stage 3 with ``options`` from ``seed``'s initial values; every step's
    loss (mean over ranks)."""
    model = GPT(cfg, seed=seed).to(device=device, dtype=DTYPES[args.dtype])
    block = {} if args.quant_block is None else {"quant_block": args.quant_block}
    opt = ShardedOptimizer(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, stage=3, max_grad_norm=1.0,
                           **options, **block)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, args.steps // 10), args.steps))
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps if args.until is None else args.until):
        x, y = synthetic_batch(cfg, args.batch_size, step=step, rank=rank, device=device)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        sched.step()
        mean = loss.detach() / world
        if world > 1:
            dist.all_reduce(mean)
        losses.append(mean.item())
        if rank == 0 and (step + 1) % 20 == 0:
            print(f"  step {step + 1:4d} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    comm = opt.comm_bytes()
    opt.close()
    return {"loss": losses, "comm_bytes": comm}


def final(losses: list, tail: int) -> float:
    return sum(losses[-tail:]) / tail


def summarize(args, cfg: GPTConfig, world: int, by_seed: dict, comm: dict) -> dict:
    """The JSON: each variant's mean curve over the seeds finished, every seed's curve, and each variant's
    paired differences (final loss over the first variant's at the same seed, minus 1), their mean and
    standard error."""
    base_name = args.variants[0]
    runs, paired, finals = {}, {}, {}
    for name, curves in by_seed.items():
        seeds = [s for s in args.seeds if s in curves]
        mean_curve = [sum(curves[s][i] for s in seeds) / len(seeds) for i in range(len(curves[seeds[0]]))]
        runs[name] = {"loss": mean_curve, "by_seed": {str(s): curves[s] for s in seeds},
                      "comm_bytes": comm[name]}
        finals[name] = final(mean_curve, args.tail)
        diffs = [final(curves[s], args.tail) / final(by_seed[base_name][s], args.tail) - 1 for s in seeds]
        mean = sum(diffs) / len(diffs)
        sem = (math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
               if len(diffs) > 1 else None)  # one seed: no spread to measure (null in the JSON, not NaN)
        paired[name] = {"per_seed": diffs, "mean": mean, "sem": sem}
    return {"config": vars(args), "world_size": world, "params": GPT(cfg).num_params(),
            "seeds": [s for s in args.seeds if s in by_seed[base_name]],
            "final": finals, "paired": paired, "runs": runs}


def plot(path: str, results: list[dict]) -> None:
    """One panel per result (``--json``'s contents), the variants' loss curves in each, their final losses'
    difference from the first variant in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4), squeeze=False, sharey=True)
    for ax, res in zip(axes[0], results):
        c, tail = res["config"], res["config"]["tail"]
        runs = res["runs"]
        base = final(next(iter(runs.values()))["loss"], tail)
        seeds = res.get("seeds", [0])
        for name, run in runs.items():
            rel = res["paired"][name]["mean"] if "paired" in res else final(run["loss"], tail) / base - 1
            ax.plot(range(1, len(run["loss"]) + 1), run["loss"], linewidth=1, label=f"{name} ({rel:+.1%})")
        ax.axhline(markov_entropy(c["vocab"], 0), color="gray", linestyle=":", linewidth=1,
                   label="the data's entropy rate")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.set_title(f"GPT {res['params'] / 1e6:.1f}M, {c.get('dtype', 'fp32')} params, ZeRO stage 3, "
                     f"{res['world_size']} ranks x {c['batch_size']} x {c['seq_len']} tokens"
                     + (f", mean of {len(seeds)} seeds" if len(seeds) > 1 else ""), fontsize=9)
        ax.legend(fontsize=8, title=f"final loss (last {tail} steps) vs the first"
                  + (", mean of the seeds' paired differences" if len(seeds) > 1 else ""), title_fontsize=8)
    axes[0][0].set_ylabel("training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        results = []
        for name in args.plot_from:
            try:
                with open(name) as f:
                    results.append(json.load(f))
            except (OSError, ValueError) as e:  # a missing or unreadable file: one line, as argparse's errors
                sys.exit(f"codec_loss.py: error: --plot-from {name}: {e}")
        plot(args.plot, results)
        return 0
    rank, world, device = setup_distributed()
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
                    seq_len=args.seq_len, tie_weights=False)
    by_seed = {name: {} for name in args.variants}
    comm = {}
    status = 0
    for seed in args.seeds:
        for name in args.variants:
            if rank == 0:
                print(f"{name}, seed {seed}:", flush=True)
            run = train(args, cfg, VARIANTS[name], rank, world, device, seed=seed)
            by_seed[name][seed] = run["loss"]
            comm[name] = run["comm_bytes"]
        if rank == 0:  # after every seed, so an interrupted run keeps what it finished
            result = summarize(args, cfg, world, by_seed, comm)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
    if rank == 0:
        base_name = args.variants[0]
        print(f"\nfinal loss (mean of the last {args.tail} of {args.until or args.steps} steps), each seed against {base_name} "
              f"at the same seed; seeds {args.seeds}:")
        for name, p in result["paired"].items():
            ok = abs(p["mean"]) <= args.tol
            status |= not ok
            seeds = " ".join(f"{d:+.2%}" for d in p["per_seed"])
            sem = "n/a, one seed" if p["sem"] is None else f"{p['sem']:.2%}"
            print(f"  {name:20s} {result['final'][name]:.4f}  mean {p['mean']:+.3%} (s.e. {sem}; "
                  f"seeds {seeds})  {'OK' if ok else 'PAST --tol'}  comm {sum(comm[name].values()) / 2**20:.1f} MiB/step")
        if args.plot:
            plot(args.plot, [result])
        status |= not all(math.isfinite(v) for v in result["final"].values())
    if dist.is_initialized():
        dist.destroy_process_group()
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
