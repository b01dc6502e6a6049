"""Launch a short 2-rank training script again and again; report how each process exited.

    python tests/_exit_launcher.py '[{"stage": 2, "destroy": false, "offload": "cpu"}, ...]'

Each entry of the list is one launch: ``stage``, ``destroy`` (the script ends with
``dist.destroy_process_group()``), ``offload`` (None, "cpu" or "nvme"), ``state_dict``
(the script ends with the collective ``optimizer.state_dict()``), ``framework_gather`` (it ends
with torch.distributed's own all-gather, as Accelerate's loss logging does), ``lone`` (rank 0
alone makes a collective call: "state_dict" mid-training, the DDP save habit; "checkpoint.save"
after training, while rank 1 goes on to another step; "state_dict_at_end", while rank 1 ends)
``raises`` (rank 1 alone raises out of step 10, uncaught: "closure", a step(closure) whose closure raises
before its backward; "bad lr", a learning rate step() refuses; "add_param_group", refused at stage 3) and ``switch``. Prints one
JSON list: per launch, the exit status of each rank (negative: killed by that signal) and
the output of a launch that did not exit 0. Used by tests/test_clean_exit.py.

Each launch is two fresh processes that end the way a training script ends: the
training function returns and the interpreter finalizes (no ``os._exit``, unlike the
test harness's ranks). They are forked from this launcher after it imported torch and
fused_zero once (about 1.5 s of CPU a process saved; nothing ran in a thread before the
fork), and rendezvous through a FileStore in a fresh folder. ``switch`` sets
``sys.setswitchinterval`` in the ranks: a long interval keeps a thread that waits for the
GIL waiting until the interpreter exits, which is how an exit-time fault shows (a
thread that needs the GIL during finalization aborts the process).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fused_zero  # noqa: E402
from fused_zero import checkpoint  # noqa: E402
from _models import TinyNet, batch, flags, loss_fn, param_groups  # noqa: E402


def train(rank: int, world_size: int, store: str, case: dict) -> None:
    """The user's script: 20 steps of backward, step, zero_grad; then maybe destroy the group."""
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = TinyNet()
    options = dict(stage=case["stage"], lr=1e-3)
    if case.get("offload"):
        options.update(offload_optimizer=case["offload"], nvme_path=case["nvme_path"])
    opt = fused_zero.ShardedOptimizer(param_groups(model), module=model, **options)
    lone, raises = case.get("lone"), case.get("raises")
    for step in range(20):
        x, y = batch(step, rank)
        if raises and step == 10 and rank == 1:  # rank 1 alone raises out of a step; the error ends its process
            if raises == "closure":  # before its backward: a data loader failing inside step(closure)
                def closure():
                    raise KeyError("the data loader failed on rank 1")
                opt.step(closure)
            if raises == "add_param_group":  # stage 3 refuses it (on this rank alone: the others go on training)
                opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
            opt.param_groups[0]["lr"] = -0.5  # "bad lr": a value step() refuses after the step's collectives
        loss_fn(model(x, **flags(step, rank)), y).backward()
        opt.step()
        opt.zero_grad()
        if lone == "state_dict" and step == 10 and rank == 0:  # DDP's save habit
            torch.save(opt.state_dict(), os.path.join(os.path.dirname(store), f"sd_{os.path.basename(store)}.pt"))
    if lone in ("checkpoint.save", "state_dict_at_end") and rank == 0:
        if lone == "checkpoint.save":
            checkpoint.save(os.path.join(os.path.dirname(store), "ckpt"), model, opt)
        else:
            opt.state_dict()
    if lone == "checkpoint.save" and rank == 1:
        x, y = batch(20, rank)
        loss_fn(model(x, **flags(20, rank)), y).backward()
        opt.step()
    if case.get("state_dict"):  # a collective that ends the script: the checkpoint habit
        opt.state_dict()
    if case.get("framework_gather"):  # a framework's own collective ends the script (Accelerate's gather)
        loss = torch.ones(1)
        out = torch.empty(world_size)
        dist.all_gather_into_tensor(out, loss)
    if case["destroy"]:
        dist.destroy_process_group()


def launch(case: dict, workdir: str, index: int) -> tuple[list[int], str]:
    """One 2-rank launch; the ranks' exit statuses (negative: killed by that signal) and their output."""
    store = os.path.join(workdir, f"store{index}")
    logs, pids = [], []
    for rank in range(2):
        log = os.path.join(workdir, f"launch{index}_rank{rank}.log")
        logs.append(log)
        pid = os.fork()
        if pid == 0:  # the rank: its output to a file, then run to the end and let the interpreter finalize
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            torch.set_num_threads(1)
            sys.setswitchinterval(case.get("switch", 0.005))
            try:
                train(rank, 2, store, case)
            except BaseException:
                import traceback
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(3)  # a failed training is not an exit fault; say so distinctly
            sys.exit(0)  # unwinds to the top of this script: the interpreter finalizes as a script's does
        pids.append(pid)
    codes, start, seconds = [], time.monotonic(), []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
        seconds.append(time.monotonic() - start)
    output = "" if codes == [0, 0] and not case.get("lone") and not case.get("raises") else "\n".join(
        f"--- rank {r} ---\n" + open(log, errors="replace").read()[-3000:] for r, log in enumerate(logs))
    return codes, output, seconds


def warm_up() -> None:
    """What the ranks would each import or build lazily (torch.optim imports Dynamo at the first
    add_param_group: 2-3 s), once here, before the fork, on one thread and without a process group."""
    torch.set_num_threads(1)
    model = TinyNet()
    opt = fused_zero.ShardedOptimizer(model, stage=3, lr=1e-3)
    x, y = batch(0, 0)
    loss_fn(model(x, **flags(1, 0)), y).backward()
    opt.step()
    opt.close()


def main() -> None:
    cases = json.loads(sys.argv[1])
    warm_up()
    results = []
    # No `with` or `finally` on the stack: a rank unwinds through these frames on its way out
    # and must not run the launcher's clean-up (it would remove the folder the other rank uses).
    workdir = tempfile.mkdtemp(prefix="fused_zero_exit_")
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme)
    for i, case in enumerate(cases):
        codes, output, seconds = launch({**case, "nvme_path": nvme}, workdir, i)
        results.append({"case": case, "codes": codes, "output": output, "seconds": seconds})
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
