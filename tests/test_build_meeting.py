"""Building the optimizer is a meeting of the ranks in the process group's store (comm/group_meeting.py): a rank that
arrives later than its peers (a slower data set-up, a bigger import) is waited for quietly.

Under torchrun the store is a TCPStore, whose client logs two c10d warnings on stderr each time a ``store.wait``
with a timeout runs out ("waitForInput ... timed out after 500ms"); the meeting waited in such slices, so every
rank that came a second late printed a screenful of them. Two fresh processes over a TCPStore (as torchrun sets
up), rank 1 building 1.5 s after rank 0, at stage 1 and then at stage 3 in the same processes: both train a step at
each stage and print nothing of the kind.
"""
from __future__ import annotations

import os
import subprocess
import sys

from _dist import free_port

SCRIPT = r"""
import os, sys, time, torch
import torch.distributed as dist
from torch import nn
from fused_zero import ShardedOptimizer
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
for stage in (1, 3):  # (stage 3 also meets at the collective calls: comm/rendezvous.py)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    if rank == 1:
        time.sleep(1.5)
    opt = ShardedOptimizer(model if stage == 3 else model.parameters(), lr=1e-3, stage=stage)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.close()
    print(f"trained at stage {stage}", flush=True)
dist.destroy_process_group()
"""


def test_a_rank_building_late_is_waited_for_without_store_warnings(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert "trained at stage 1" in out and "trained at stage 3" in out, out
        assert "waitForInput" not in out and "timed out" not in out, out
