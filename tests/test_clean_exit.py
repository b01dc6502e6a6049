"""A training script that finishes exits 0, every time (issue: one run in five ended in SIGABRT).

The fault this guards against shows only when a process ends: a collective's thread
that still owns a Work when the interpreter finalizes takes the GIL and is ended inside a
C++ destructor ("terminate called without an active exception", exit -6). Every other
test ends its ranks with ``os._exit``; here each launch is two fresh processes that fall
off the end of a 2-rank training script (tests/_exit_launcher.py), at stages 1-3, with and
without ``dist.destroy_process_group()``, with the states offloaded to host memory and to
NVMe, and ending with the collective ``optimizer.state_dict()`` or with a collective of
torch.distributed's own that a framework issues (Accelerate gathers the loss for its log,
then ``end_training()`` destroys the group). The ranks run with a
long GIL switch interval, so a thread that waits for the GIL at exit is still waiting
when the interpreter finalizes: before the fix (comm/pins.py, "pinned alias") about half
of these launches at stages 1-2 aborted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exit_launcher.py")

#: Five launches per stage: each ending of the script once (before the fix about half of the launches at
#: stages 1-2 aborted: ten of them all exit 0 by chance about once in a thousand).
ENDINGS = [dict(destroy=False), dict(destroy=True, framework_gather=True), dict(destroy=False, offload="cpu"),
           dict(destroy=True, offload="nvme"), dict(destroy=False, state_dict=True, framework_gather=True)]
LAUNCHES = [dict(stage=stage, switch=1.0, **ending) for stage in (1, 2, 3) for ending in ENDINGS]


def test_every_launch_exits_0():
    run = subprocess.run([sys.executable, LAUNCHER, json.dumps(LAUNCHES)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout)
    assert len(results) == len(LAUNCHES)
    failed = [r for r in results if r["codes"] != [0, 0]]
    assert not failed, (f"{len(failed)} of {len(results)} launches did not exit 0:\n" + "\n".join(
        f"{r['case']} exited {r['codes']}:\n{r['output']}" for r in failed[:3]))
