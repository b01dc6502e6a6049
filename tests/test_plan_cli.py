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
STAGE_KEYS = {"params", "grads", "optimizer", "buffers", "gathered", "staging", "activations", "total", "comm_bytes",
              "stage", "offload", "offload_optimizer", "offload_params", "fits", "fits_device", "fits_host", "tiers",
              "per_node", "detail"}
TIERS = {"1+opt=cpu", "1+opt=nvme", "2+opt=cpu", "2+opt=nvme", "3+opt=cpu", "3+opt=nvme", "3+params=cpu",
         "3+params=nvme", "3+opt=cpu,params=cpu", "3+opt=cpu,params=nvme", "3+opt=nvme,params=cpu",
         "3+opt=nvme,params=nvme"}
NOT_INT = {"stage", "offload", "offload_optimizer", "offload_params", "fits", "fits_device", "fits_host", "tiers",
           "per_node", "detail"}


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
    assert set(data["stages"]) == {"0", "1", "2", "3"} | TIERS
    for k, s in data["stages"].items():
        assert set(s) == STAGE_KEYS
        assert k == (str(s["stage"]) if s["offload"] == "none" else f"{s['stage']}+{s['offload']}")
        assert all(isinstance(s[f], int) and s[f] >= 0 for f in STAGE_KEYS - NOT_INT)
        assert s["total"] == sum(s[f] for f in ("params", "grads", "optimizer", "buffers", "gathered", "staging",
                                                "activations"))
        assert s["activations"] == 10 << 30 and s["tiers"]["device"] == s["total"]
        assert s["per_node"] == {"host": 8 * s["tiers"]["host"], "nvme": 8 * s["tiers"]["nvme"]}
        assert s["fits_host"] is None and s["fits"] == s["fits_device"]
        if s["offload"] == "none":
            assert s["tiers"] == {"device": s["total"], "host": 0, "nvme": 0} and s["offload_optimizer"] is None
        else:
            assert s["optimizer"] == (0 if s["offload_optimizer"] else data["stages"][str(s["stage"])]["optimizer"])
            assert s["tiers"]["host"] + s["tiers"]["nvme"] > 0
    assert data["stages"]["3+opt=cpu,params=cpu"]["offload_params"] == "cpu"
    rec = data["recommendation"]
    assert set(rec) >= {"stage", "offload", "fits", "reason", "host_usable"}
    assert rec["stage"] == 2 and rec["fits"] is True
    assert data["model"]["params"] == 7_000_000_000 and data["job"]["world_size"] == 8
    assert data["job"]["host_memory"] is None and data["job"]["max_offload"] == "nvme"


def test_offload_table_and_recommendation(capsys):
    argv = ["--params", "7e9", "--gpu-memory", "24GiB", "--layers", "32"]
    code, out, _ = _run(argv + ["--host-memory", "128GiB"], capsys)
    assert code == 0
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("offload tiers, GiB")))
    assert "host and NVMe per node of 1 rank, host 115.2 GiB usable" in lines[start]
    rows = lines[start + 2:start + 8]
    assert 'stage=2, offload_optimizer="cpu"' in rows[0]
    best = [r for r in rows if r.endswith("<- recommended")]
    assert best == rows[:1]  # the cheapest tier that fits
    # 7B bf16 on one GPU: the 2Ψ params (13.04 GiB) stay; the 12Ψ states and 2Ψ grads go to the host
    # no upload staging; on the device, two 16M-element bf16 bucket shards an accumulating backward is added in
    assert best[0].split()[:4] == ["13.16", "91.27", "0.00", "yes"]
    assert 'recommendation: stage 2 with offload_optimizer="cpu": 13.2 GiB' in out
    assert "the optimizer states and the gradient shard in host memory" in out
    code, out, _ = _run(argv + ["--host-memory", "64GiB"], capsys)
    assert code == 0 and "no (host)" in out
    assert 'recommendation: stage 2 with offload_optimizer="nvme": 13.2 GiB' in out
    assert "the optimizer states on NVMe, the gradient shard in host memory" in out
    code, out, _ = _run(argv + ["--max-offload", "none"], capsys)
    assert code == 0 and "recommendation: does not fit" in out and "--max-offload none" in out
    code, out, _ = _run(argv + ["--json", "--nodes", "1", "--host-memory", "64GiB"], capsys)
    data = json.loads(out)
    assert data["recommendation"]["offload"] == "opt=nvme"
    assert data["stages"]["3+opt=cpu,params=cpu"]["fits"] is False
    assert data["stages"]["3+opt=cpu,params=cpu"]["fits_device"] is True


def test_host_memory_without_gpu_memory_lists_the_tiers(capsys):
    """--host-memory alone: no recommendation (nothing says what fits on the GPU), but the table and the tiers
    with the node's usable host memory, not a TypeError."""
    code, out, _ = _run(["--params", "7e9", "--host-memory", "64GiB"], capsys)
    assert code == 0
    assert "no --gpu-memory given" in out and "host 57.6 GiB usable" in out
    code, out, _ = _run(["--params", "7e9", "--host-memory", "64GiB", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["recommendation"]["stage"] is None


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


@pytest.mark.parametrize("where,words", [("x.txt", "suffix picks the format"), ("x", "suffix picks the format"),
                                         (".", "is a folder"), ("missing/x.png", "does not exist")])
def test_plot_paths_it_cannot_write_are_refused_before_any_output(tmp_path, capsys, where, words):
    """Before: a raw matplotlib traceback after the table (x.txt), 'x.png' written but 'wrote x' reported, a
    folder given written as folder.png beside it, a missing folder refused only after the table."""
    pytest.importorskip("matplotlib")
    code, out, err = _run(SEVEN_B + ["--plot", str(tmp_path / where)], capsys)
    assert code == 2 and words in err and out == "", (code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):  # importing them now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    code, out, err = _run(SEVEN_B + ["--plot", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "pip install matplotlib" in err and "'.[plot]'" in err and out == "" and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv,words", [
    (["--params", "-5"], "negative"),
    (["--params", "0"], "at least one parameter"),
    (["--params", "lots"], "not a parameter count"),
    (SEVEN_B[:2] + ["--world-size", "0"], "not a whole number >= 1"),
    (SEVEN_B[:2] + ["--param-dtype", "int8"], "invalid choice"),
    (SEVEN_B[:2] + ["--gpu-memory", "80 parsecs"], "not a size"),
    # float infinity: an OverflowError's traceback (exit code 1) before
    (SEVEN_B[:2] + ["--gpu-memory", "1e300GiB"], "argument --gpu-memory: '1e300GiB' is too large"),
    (SEVEN_B[:2] + ["--host-memory", "1e400"], "argument --host-memory: '1e400' is too large"),
    (SEVEN_B[:2] + ["--activations", "1e400GiB"], "argument --activations: '1e400GiB' is too large"),
    (["--params", "1e400"], "argument --params: '1e400' is too large"),
    (["--params", "1.5"], "'1.5' is not a whole number of parameters (1.5B"),  # was planned as one parameter
    (SEVEN_B[:2] + ["--nodes", "2"], "--nodes 2 needs --gpus-per-node"),  # was "world_size 1 is not a multiple"
    (SEVEN_B[:2] + ["--activation-checkpointing"], "give --seq-len, --micro-batch"),  # was silently ignored
    # layers: 1e9 ran for minutes eating memory (a stage 3 unit each), and more layers than parameters passed
    (SEVEN_B[:2] + ["--layers", "100001"], "argument --layers: 100001 layers is more than 100000"),
    (["--params", "10", "--layers", "20"], "argument --layers: 20 layers is more than the 10 parameters"),
    (["--params", "10", "--layers", "20", "--seq-len", "8", "--micro-batch", "1", "--hidden", "8"],
     "argument --layers: 20 layers is more than the 10 parameters"),
    (SEVEN_B[:2] + ["--headroom", "1.5"], "fraction"),
    (SEVEN_B[:2] + ["--world-size", "8", "--nodes", "3"], "multiple of nodes"),
    (SEVEN_B[:2] + ["--seq-len", "128"], "together"),
    (SEVEN_B[:2] + ["--world-size", "8", "--nodes", "2", "--gpus-per-node", "2"], "--gpus-per-node 2"),
    (SEVEN_B[:2] + ["--gpus-per-node", "0"], "not a whole number >= 1"),
    (SEVEN_B[:2] + ["--host-memory", "0"], "host_memory must be positive"),
    (SEVEN_B[:2] + ["--host-memory", "lots"], "not a size"),
    (SEVEN_B[:2] + ["--max-offload", "disk"], "invalid choice"),
    (SEVEN_B[:2] + ["--offload-chunk-numel", "0"], "not a whole number >= 1"),
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


def test_picture_shows_the_stages_and_the_recommended_tier(tmp_path):
    from fused_zero.plan import estimate
    from fused_zero.plan.picture import bars, draw
    plan = estimate(7e9, gpu_memory=24 << 30, layers=32)
    shown = bars(plan)
    assert [(s.stage, s.offload) for s in shown] == [(0, "none"), (1, "none"), (2, "none"), (3, "none"),
                                                      (2, "opt=cpu")]
    assert len(bars(estimate(7e9, world_size=8, gpu_memory=80 << 30))) == 4  # fits without offload
    pytest.importorskip("matplotlib")
    draw(plan, str(tmp_path / "offload.png"))
    assert (tmp_path / "offload.png").read_bytes()[:4] == b"\x89PNG"


def test_traffic_per_level_with_nodes_and_gpus_per_node(capsys):
    """--nodes 2 --gpus-per-node 4: 8 ranks, and each stage's traffic inside a node and across nodes as flat ZeRO,
    HSDP and hpZ (JSON: the same rows); one node shows none."""
    argv = ["--params", "1e9", "--nodes", "2", "--gpus-per-node", "4", "--layers", "8"]
    code, out, _ = _run(argv, capsys)
    assert code == 0 and "8 ranks on 2 nodes" in out
    block = out[out.index("traffic per level"):].splitlines()
    assert "HSDP: shard group = a node; hpZ: secondary_shard=4" in block[0]
    rows = [line for line in block[2:9]]
    assert [r.split()[:3] for r in rows] == [["stage", "1", "flat"], ["stage", "1", "HSDP"], ["stage", "2", "flat"],
                                            ["stage", "2", "HSDP"], ["stage", "3", "flat"], ["stage", "3", "HSDP"],
                                            ["stage", "3", "hpZ"]], rows
    code, out, _ = _run(argv + ["--json"], capsys)
    levels = json.loads(out)["levels"]
    assert [(r["layout"], r["stage"]) for r in levels] == [("flat", 1), ("hsdp", 1), ("flat", 2), ("hsdp", 2),
                                                          ("flat", 3), ("hsdp", 3), ("hpz", 3)]
    for r in levels:
        assert r["inside"] + r["across"] == sum(r["comm"].values()) > 0
        assert r["inside"] == 0 if r["layout"] == "flat" else r["inside"] > r["across"] if r["layout"] == "hsdp" \
            else r["inside"] == r["comm"]["secondary_all_gather"] > 0
    code, out, _ = _run(["--params", "1e9", "--world-size", "8"], capsys)
    assert code == 0 and "traffic per level" not in out


def test_codec_flags_plan_the_payloads_per_level(capsys):
    """--grad-comm / --param-comm / --quant-block reach estimate(): the table names the codecs and shows each
    row's coded part inside and across nodes, the JSON the codecs' keys; a block ZeroConfig refuses is refused."""
    from fused_zero.plan import estimate
    argv = ["--params", "1e9", "--nodes", "2", "--gpus-per-node", "4", "--layers", "8"]
    code, out, _ = _run(argv + ["--grad-comm", "int4", "--param-comm", "int8", "--quant-block", "64"], capsys)
    assert code == 0
    block = out[out.index("traffic per level"):].splitlines()
    assert block[1].startswith("codecs: grad_comm=int4, param_comm=int8 (stage 3), quant_block=64")
    assert block[2].split()[-4:] == ["coded", "inside", "coded", "across"]
    plan = estimate(1e9, world_size=8, nodes=2, layers=8, grad_comm="int4", param_comm="int8", quant_block=64)
    for line, r in zip(block[3:10], plan.levels):
        cells = [float(c) for c in line.split()[-5:] if c != "-"]
        want = [r.inside, r.across] + ([r.secondary] if r.layout == "hpz" else []) + [r.coded_inside, r.coded_across]
        assert cells == [round(n / (1 << 30), 2) for n in want], (line, r)
        assert r.coded_inside + r.coded_across > 0
    code, out, _ = _run(argv + ["--grad-comm", "int4", "--json"], capsys)
    levels = json.loads(out)["levels"]
    assert all(r["comm"]["reduce_scatter_int4"] > 0 == r["comm"]["reduce_scatter"] for r in levels)
    assert all("all_gather_int8" not in r["comm"] for r in levels)
    code, out, _ = _run(argv, capsys)
    assert "codecs:" not in out and "coded" not in out
    code, out, err = _run(["--params", "1e9", "--grad-comm", "int8", "--quant-block", "100"], capsys)
    assert code == 2 and "quant_block must be a power of two from 32 to 8192" in err
    code, out, err = _run(["--params", "1e9", "--param-comm", "int4"], capsys)
    assert code == 2 and "invalid choice: 'int4'" in err
