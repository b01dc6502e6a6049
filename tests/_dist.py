"""Run a test function on N gloo ranks, each in its own fresh process.

    results = run_ranks(fn, world_size, *args, timeout=120, **kwargs)

``fn(rank, world_size, *args, **kwargs)`` runs on every rank with a gloo default
process group initialised (FileStore rendezvous in a fresh temporary folder, gloo on
the loopback interface), ``torch.manual_seed(1234)`` and one thread. Its return
values come back in rank order. ``fn`` must be a module-level function of an
importable module (a test file: pytest puts tests/ on sys.path and the ranks inherit
sys.path), and its arguments and results must pickle.

If a rank raises or dies, the others are killed and the parent raises ``RanksFailed``
with that rank's full traceback and the tail of its output. If ranks do not finish
within ``timeout`` seconds (counted from the start, start-up included), the stuck ones
dump their Python stacks (faulthandler on SIGUSR1), are killed, and ``RanksFailed``
names them and shows where they were.

Start-up. A "spawn" process imports torch itself: about 2 s of CPU per rank, so 4 ranks
take 4-8 s on two cores before ``fn`` runs. Ranks therefore start from a "forkserver"
that imported torch, fused_zero and the installed frameworks once per test session (the first
call pays ~2-10 s, later ones ~0.1 s). The server is a clean process that never ran a test, so the ranks are as
fresh as spawned ones, and each rank gets the caller's current os.environ, working
folder and sys.path (variables read only while those modules import come from the first
call's environment).
FUSED_ZERO_TEST_START=spawn switches to plain spawn. Ranks end with ``os._exit``
(interpreter shutdown with torch loaded takes 1-4 s), so atexit handlers do not run.
"""
from __future__ import annotations

import datetime
import faulthandler
import importlib.util
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

_LOG_TAIL = 4000  # characters of a failed rank's output shown in the error


class RanksFailed(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a TCPStore / MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the forkserver imports once for every rank: torch, the package, and the frameworks the integration tests
# run when they are installed (transformers and lightning take 3-4 s of CPU each to import, per rank, per call)
_PRELOAD = ["torch", "torch.distributed", "fused_zero"] + [
    m for m in ("transformers", "transformers.trainer", "accelerate", "peft", "lightning.pytorch")
    if importlib.util.find_spec(m.split(".")[0]) is not None]


def _context():
    method = os.environ.get("FUSED_ZERO_TEST_START", "forkserver")
    if method == "forkserver" and method in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts
        return ctx
    return mp.get_context("spawn")


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # the parent never sees half a file


def _child(rank: int, world_size: int, workdir: str, payload: bytes, where: tuple, timeout: float) -> None:
    # Everything this rank prints, C++ aborts included, goes to its own log file.
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w", buffering=1)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    env, cwd, path = where  # the caller's, now (a forkserver child has the server's, from its start)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    result_path = os.path.join(workdir, f"rank{rank}.result")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        loopback = [n for _, n in socket.if_nameindex() if n in ("lo", "lo0")]
        if loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])
        dist.init_process_group(
            "gloo", init_method="file://" + os.path.join(workdir, "store"), rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
        )
        torch.manual_seed(1234)
        fn, args, kwargs = pickle.loads(payload)
        data = pickle.dumps(("ok", fn(rank, world_size, *args, **kwargs)))
    except BaseException:
        _write(result_path, pickle.dumps(("error", time.time(), traceback.format_exc())))
        log.flush()
        os._exit(1)  # do not wait for peers that may be stuck in a collective
    _write(result_path, data)
    dist.barrier()  # let every rank finish its last collective before connections close
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush(), log.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"run_ranks could not pickle {fn!r} and its arguments ({e}); fn must be a module-level "
            "function of an importable module (no lambdas or local functions) and arguments must pickle"
        ) from e
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="fused_zero_ranks_")
    where = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(target=_child, args=(r, world_size, workdir, payload, where, timeout), daemon=True,
                    name=f"rank{r}")
        for r in range(world_size)
    ]
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.start()
        while True:
            codes = [p.exitcode for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                _kill(procs)
                raise RanksFailed(_failure_report(workdir, procs, failed))
            if all(c == 0 for c in codes):
                return [_read_result(workdir, r)[1] for r in range(world_size)]
            if time.monotonic() > deadline:
                raise RanksFailed(_timeout_report(workdir, procs, timeout))
            time.sleep(0.02)
    finally:
        _kill(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def _kill(procs) -> None:
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.kill()
    for p in started:
        p.join(timeout=10)


def _read_result(workdir: str, rank: int):
    try:
        with open(os.path.join(workdir, f"rank{rank}.result"), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def _tail(workdir: str, rank: int) -> str:
    try:
        with open(os.path.join(workdir, f"rank{rank}.log"), errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log: it failed while starting, before its log opened; see the test's stderr)"
    text = text if len(text) <= _LOG_TAIL else "..." + text[-_LOG_TAIL:]
    return text or "(no output)"


def _failure_report(workdir: str, procs, failed: list[int]) -> str:
    results = {r: _read_result(workdir, r) for r in failed}
    raised = sorted((res[1], r) for r, res in results.items() if res is not None and res[0] == "error")
    if raised:  # the earliest error is the cause; later ones are usually peers losing their connection
        first = raised[0][1]
        lines = [f"rank {first} of {len(procs)} raised:\n{results[first][2]}"]
        for _, r in raised[1:]:
            last = [line for line in results[r][2].splitlines() if line and not line[0].isspace()][-1]
            lines.append(f"rank {r} also raised: {last}")
        for r in failed:
            if results[r] is None:
                lines.append(f"rank {r} also died with exit code {procs[r].exitcode} without reporting")
    else:
        first = failed[0]
        lines = [f"rank {first} of {len(procs)} died with exit code {procs[first].exitcode} without "
                 "reporting (a negative code is the signal that killed it)"]
    lines.append(f"--- rank {first} output (tail) ---\n{_tail(workdir, first)}")
    return "\n".join(lines)


def _timeout_report(workdir: str, procs, timeout: float) -> str:
    stuck = [r for r in range(len(procs)) if _read_result(workdir, r) is None]
    waiting = [r for r, p in enumerate(procs) if r not in stuck and p.exitcode is None]
    for r in stuck:  # ask for Python stacks before killing
        if hasattr(signal, "SIGUSR1") and procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    _kill(procs)
    msg = [f"ranks {stuck} of {len(procs)} did not finish within {timeout} s and were killed"]
    if waiting:
        msg.append(f"(ranks {waiting} had returned from fn and were waiting for them in the final barrier)")
    for r in stuck:
        msg.append(f"--- rank {r} output and stacks (tail) ---\n{_tail(workdir, r)}")
    return "\n".join(msg)
