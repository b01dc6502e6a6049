"""fused_zero.ops._backend: which implementation runs each op, and that CPU never imports triton."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fused_zero import ops  # noqa: F401  (registers every op)
from fused_zero.ops import _backend

CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
OPS = ("adamw", "cast", "norm", "pack", "unpack")


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("FUSED_ZERO_BACKEND", raising=False)
    return monkeypatch


def test_every_op_has_triton_and_torch():
    for op in OPS:
        assert _backend.registered(op)[0] == "triton" and _backend.registered(op)[-1] == "torch"
    assert _backend.registered("adamw") == ("triton", "native", "torch")


def test_default_selection_by_device(env):
    for op in OPS:
        assert _backend.select(op, CUDA) == "triton"
        assert _backend.select(op, META) == "torch"
        assert _backend.select(op, CPU) == ("native" if op == "adamw" else "torch")
    assert _backend.implementation("norm", CPU) is ops.norm.norm_stats_twin
    assert _backend.implementation("cast", CUDA).__name__ == "kernels.cast.cast"


@pytest.mark.parametrize("value", ["torch", " Torch "])
def test_env_forces_the_twin_on_every_device(env, value):
    env.setenv("FUSED_ZERO_BACKEND", value)
    for op in OPS:
        assert _backend.select(op, CPU) == "torch"
        assert _backend.select(op, CUDA) == "torch"


def test_env_triton_on_cpu_needs_the_interpreter(env):
    env.setenv("FUSED_ZERO_BACKEND", "triton")
    env.setenv("TRITON_INTERPRET", "1")
    assert _backend.select("adamw", CPU) == "triton"
    env.setenv("TRITON_INTERPRET", "0")
    assert _backend.select("adamw", CUDA) == "triton"
    with pytest.raises(RuntimeError, match="FUSED_ZERO_BACKEND=triton needs CUDA tensors, or "
                                           "TRITON_INTERPRET=1"):
        _backend.select("adamw", CPU)
    with pytest.raises(RuntimeError, match="FUSED_ZERO_BACKEND=triton needs CUDA tensors"):
        ops.norm_stats(torch.zeros(3))


def test_env_rejects_other_values(env):
    env.setenv("FUSED_ZERO_BACKEND", "native")
    with pytest.raises(ValueError, match="FUSED_ZERO_BACKEND must be 'triton' or 'torch', got 'native'"):
        _backend.select("adamw", CPU)
    with pytest.raises(ValueError, match="FUSED_ZERO_BACKEND must be 'triton' or 'torch'"):
        ops.cast_(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))


def test_register_checks_names():
    with pytest.raises(ValueError, match=r"unknown backends \['cuda'\]"):
        _backend.register("x", triton=print, torch=print, cuda=print)
    with pytest.raises(ValueError, match="needs a triton and a torch implementation"):
        _backend.register("x", torch=print)
    assert "x" not in _backend._REGISTRY


_CPU_CALLS = """
import sys
import torch
import fused_zero
from fused_zero import ops

p = torch.randn(100)
ops.adamw_(p, torch.randn(100).bfloat16(), torch.zeros(100), torch.zeros(100), step=1, lr=1e-3,
           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
           param_out=torch.empty(100, dtype=torch.bfloat16))
assert ops.norm_stats(p).nonfinite.item() == 0.0
out = torch.empty(100, dtype=torch.bfloat16)
assert torch.equal(ops.cast_(p, out), p.bfloat16())
bucket = torch.zeros(110)
plan = ops.pack_plan([p], [5], bucket)
ops.pack_([p], bucket, plan=plan, scale=0.5)
back = torch.empty(100)
ops.unpack_(bucket, [back], plan=plan)
assert torch.equal(back, p * 0.5)
assert sys.modules.get("triton") is None, sorted(m for m in sys.modules if "triton" in m)  # (None: blocked)
assert not any(m.startswith("fused_zero.kernels") for m in sys.modules)
print("ok")
"""

_NO_TRITON = """
import sys

sys.modules["triton"] = None  # as on a machine without it: import raises ImportError, importlib's find_spec gives
                              # None (a CUDA build of torch looks for it with find_spec while torch imports)
"""


@pytest.mark.parametrize("backend", ["", "torch"])
@pytest.mark.parametrize("triton_installed", [True, False], ids=["triton", "no-triton"])
def test_cpu_use_never_imports_triton(backend, triton_installed):
    env = {k: v for k, v in os.environ.items() if k not in ("FUSED_ZERO_BACKEND", "TRITON_INTERPRET")}
    if backend:
        env["FUSED_ZERO_BACKEND"] = backend
    code = (_NO_TRITON if not triton_installed else "") + _CPU_CALLS
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "ok"
