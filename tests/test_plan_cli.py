"""python -m fused_zero.plan: the table, --json's schema, --plot's PNG, and errors without tracebacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fused_zero.plan.__main__ import main

TESTS = os.path.dirname(os.path.abspath(__file__))
SEVEN_B = ["--params", "7e9", "--world-size", "8", "--gpu-memory", "80GiB"]
STAGE_KEYS = {"params", "grads", "optimizer", "buffers", "gathered", "activations", "total", "comm_bytes",
              "stage", "offload", "fits", "tiers", "detail"}


def broken():
    raise RuntimeError("this model cannot be built")


def _run(argv, capsys):
    """(exit code, stdout, stderr) of main(argv) in this process."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table(capsys):
    code, out, _ = _run(SEVEN_B, capsys)
    assert code == 0
    for words in ("stage 0 (DDP)", "stage 3", "optimizer states", "gathered units", "total", "fits 72.0 GiB",
                  "comm/step", "3Ψ", "recommendation: stage 2:"):
        assert words in out, words
    total = next(line for line in out.splitlines() if line.startswith("total")).split()[1:]
    # Ψ = 7e9 = 6.52 GiB of bf16 elements / 2; pool: two 2**24-element bf16 buckets = 0.0625 GiB.
    # 16Ψ; (2 + 2 + 12/8)Ψ + grad shard 2Ψ/8 + param shard 2Ψ/8 + pool; (2 + 14/8)Ψ + 2Ψ/8 + pool; 16Ψ/8 + pool
    assert [float(v) for v in total] == [104.31, 39.18, 26.14, 13.10]


def test_json_schema(capsys):
    code, out, _ = _run(SEVEN_B + ["--json", "--activations", "10GiB"], capsys)
    assert code == 0
    data = json.loads(out)
    assert set(data) >= {"stages", "recommendation", "model", "job", "notes"}
    assert set(data["stages"]) == {"0", "1", "2", "3"}
    for k, s in data["stages"].items():
        assert set(s) >= STAGE_KEYS and s["stage"] == int(k) and s["offload"] == "none"
        assert all(isinstance(s[f], int) and s[f] >= 0 for f in STAGE_KEYS - {"stage", "offload", "fits", "tiers",
                                                                                 "detail"})
        assert s["total"] == sum(s[f] for f in ("params", "grads", "optimizer", "buffers", "gathered", "activations"))
        assert s["activations"] == 10 << 30 and s["tiers"] == {"device": s["total"], "host": 0, "nvme": 0}
    rec = data["recommendation"]
    assert set(rec) >= {"stage", "offload", "fits", "reason"} and rec["stage"] == 2 and rec["fits"] is True
    assert data["model"]["params"] == 7_000_000_000 and data["job"]["world_size"] == 8


def test_model_option(capsys):
    argv = ["--model", "test_plan_measured:mixed_net", "--model-path", TESTS, "--world-size", "2", "--json"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["model"]["exact"] and data["model"]["source"] == "test_plan_measured:mixed_net"
    assert data["model"]["frozen"] > 0 and set(data["model"]["by_dtype"]) == {"fp32", "bf16"}


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    code, _, err = _run(SEVEN_B + ["--seq-len", "4096", "--micro-batch", "1", "--hidden", "4096", "--layers", "32",
                                   "--plot", str(path)], capsys)
    assert code == 0 and "wrote" in err
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):  # importing them now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    code, out, err = _run(SEVEN_B + ["--plot", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "pip install fused_zero[plot]" in err and out == "" and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv,words", [
    (["--params", "-5"], "negative"),
    (["--params", "0"], "at least one parameter"),
    (["--params", "lots"], "not a parameter count"),
    (SEVEN_B[:2] + ["--world-size", "0"], "not a whole number >= 1"),
    (SEVEN_B[:2] + ["--param-dtype", "int8"], "invalid choice"),
    (SEVEN_B[:2] + ["--gpu-memory", "80 parsecs"], "not a size"),
    (SEVEN_B[:2] + ["--headroom", "1.5"], "fraction"),
    (SEVEN_B[:2] + ["--world-size", "8", "--nodes", "3"], "multiple of nodes"),
    (SEVEN_B[:2] + ["--seq-len", "128"], "together"),
    (["--model", "test_plan_cli:broken", "--model-path", TESTS], "raised RuntimeError: this model cannot be built"),
    (["--model", "no_such_module_xyz:f"], "could not import"),
    (["--model", "json"], "MODULE:CALLABLE"),
    (["--model", "json:dumps"], "raised TypeError"),
    (["--model", "test_plan_cli:TESTS", "--model-path", TESTS], "not a callable"),
    ([], "one of the arguments --params --model is required"),
])
def test_bad_input_exits_2_with_one_error_line(argv, words, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert "error: " in err and words in err and "Traceback" not in err, err


def test_module_entry_point_and_optional_matplotlib():
    code = ("import sys; sys.modules['matplotlib'] = None; import fused_zero.plan, fused_zero.plan.report, "
            "fused_zero.plan.picture; from fused_zero.plan.__main__ import main; sys.exit(main(['--params', '1e9']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "recommendation:" in done.stdout, done.stderr
    bad = subprocess.run([sys.executable, "-m", "fused_zero.plan", "--params", "1e9", "--world-size", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("python -m fused_zero.plan: error:")
