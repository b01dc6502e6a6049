"""ShardedOptimizer.memory_bytes(): the bytes one rank holds for the model state, by kind and tier.

Counted from the partitions' actual storages (what ``plan/memory.py`` predicts exactly): the flat
parameter buffers, ``.grad`` and the reduced gradient shards, the optimizer states (offloaded ones
under their tier, "host" or "nvme"), stage 3's narrow param shards, GradSync's pool buffers, and
the frozen parameters' weights (stage 3: their shards; stages 1-2: the user's whole tensors), and with
hpZ (``secondary_shard``) the node-local copies of the units a forward released ("secondary": its most at
the end of a training forward, none after the backward).
"""
from __future__ import annotations

from .frozen import frozen_bytes
from .tiers.tier import Tier


def memory_bytes(opt) -> dict[str, int]:
    stage = opt._stage
    totals = dict.fromkeys(["params", "grads", "master", "exp_avg", "exp_avg_sq", "buffers"], 0)
    for part in opt.partitions + stage.frozen_parts:
        b = part.shard_bytes()
        totals["params"] += b["params"]
        totals["grads"] += sum(p.grad.numel() * p.grad.element_size() for p in part.params if p.grad is not None)
        # the reduced shard lives where the update runs: on the host when the states are offloaded
        where = "grads" if part.grad_tier is Tier.DEVICE else part.grad_tier.value
        totals[where] = totals.get(where, 0) + b["grad_shard"]
        for kind in part.store.kinds:  # offloaded states count under their tier ("host", "nvme")
            where = kind if part.store.tier is Tier.DEVICE else part.store.tier.value
            totals[where] = totals.get(where, 0) + b[kind]
        # stage 3: the narrow param shard is the resident copy of the params (offloaded: under its tier)
        totals["params" if stage.shards_params else "buffers"] += b["param_shard"]
        if part.param_tier is not Tier.DEVICE:
            totals[part.param_tier.value] = totals.get(part.param_tier.value, 0) + b["param_shard_offloaded"]
    if not stage.shards_params:
        totals["params"] += frozen_bytes(stage.frozen)
    totals["buffers"] += opt.grad_sync.buffer_bytes()
    totals.update(stage.held_bytes())  # stage 3 with hpZ: the node-local copies held now ("secondary")
    return totals
