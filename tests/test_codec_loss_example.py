"""examples/codec_loss.py's judgement: each codec run is paired with the full-precision run of the same
seed, and the mean of the paired differences (not one seed's) is what ``--tol`` bounds."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import codec_loss  # noqa: E402
from gpt import GPTConfig  # noqa: E402


def _args(*extra):
    return codec_loss.parse_args(["--steps", "4", "--tail", "2", *extra])


def test_summarize_pairs_each_seed_with_full_precision_at_that_seed():
    args = _args("--seeds", "3", "7", "--variants", "full precision", 'param_comm="int8"')
    cfg = GPTConfig(vocab=16, d_model=8, n_layer=1, n_head=2, seq_len=4)
    # seed 3's full-precision run ends at 2.0, seed 7's at 4.0; the codec's +10% at seed 3 and -5% at 7
    by_seed = {"full precision": {3: [9, 9, 2.0, 2.0], 7: [9, 9, 4.0, 4.0]},
               'param_comm="int8"': {3: [9, 9, 2.2, 2.2], 7: [9, 9, 3.8, 3.8]}}
    comm = {name: {"all_gather": 1} for name in by_seed}
    res = codec_loss.summarize(args, cfg, 2, by_seed, comm)
    p = res["paired"]['param_comm="int8"']
    assert p["per_seed"] == pytest.approx([0.10, -0.05])
    assert p["mean"] == pytest.approx(0.025)
    assert p["sem"] == pytest.approx(0.075)  # sample std of (0.10, -0.05) over sqrt(2)
    # the ratio of the mean curves would say (2.2 + 3.8) / (2.0 + 4.0) - 1 = 0: not what is judged
    assert res["final"]['param_comm="int8"'] == pytest.approx(res["final"]["full precision"])
    assert res["runs"]['param_comm="int8"']["loss"] == pytest.approx([9, 9, 3.0, 3.0])
    assert res["runs"]["full precision"]["by_seed"] == {"3": [9, 9, 2.0, 2.0], "7": [9, 9, 4.0, 4.0]}
    assert res["seeds"] == [3, 7]


def test_summarize_after_some_seeds_keeps_what_finished():
    args = _args("--seeds", "0", "1", "--variants", "full precision", 'grad_comm="int4"')
    cfg = GPTConfig(vocab=16, d_model=8, n_layer=1, n_head=2, seq_len=4)
    by_seed = {"full precision": {0: [3, 3, 2.0, 2.0]}, 'grad_comm="int4"': {0: [3, 3, 2.02, 2.02]}}
    res = codec_loss.summarize(args, cfg, 2, by_seed, {n: {} for n in by_seed})
    assert res["seeds"] == [0]
    assert res["paired"]['grad_comm="int4"']["mean"] == pytest.approx(0.01)
    assert res["paired"]['grad_comm="int4"']["sem"] is None  # one seed: no standard error (valid JSON: null)
    json.loads(json.dumps(res, allow_nan=False))


@pytest.mark.parametrize("seeds", [["1", "1"], ["-1"]])
def test_seeds_must_be_distinct_and_non_negative(seeds, capsys):
    with pytest.raises(SystemExit):
        _args("--seeds", *seeds)
    assert "--seeds" in capsys.readouterr().err


@pytest.mark.parametrize("until", ["1", "5"])
def test_until_must_hold_the_tail_and_stay_in_the_schedule(until, capsys):
    with pytest.raises(SystemExit):
        _args("--tail", "2", "--until", until) if until == "1" else _args("--until", until)
    assert "--until" in capsys.readouterr().err
