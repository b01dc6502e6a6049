"""fused_zero.checkpoint_format: the pure pieces of the checkpoint format, against brute force."""
import math
import random

import pytest
import torch

from fused_zero.checkpoint_format import (CheckpointError, Chunk, NotJSON, check_tag, check_tiling, chunks, crc32,
                                          decode, describe_mismatch, encode, json_ok, overlapping)
from fused_zero.layout import build_layout


def test_codec_round_trips_what_schedulers_and_groups_hold():
    import json

    value = {"lr": 1e-3, "betas": (0.9, 0.999), "steps": [1, 2.5, None, True], "name": "x",
             "nested": {"t": (1, (2, 3))}, 3: "int key", "__odd": 1, "inf": math.inf, "nan": math.nan,
             "lr_t": torch.tensor(3e-4), "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
             "ints": torch.arange(6).reshape(2, 3)}
    back = decode(json.loads(json.dumps(encode(value))))
    assert back.keys() == value.keys()
    for k, v in value.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        elif isinstance(v, float) and math.isnan(v):
            assert math.isnan(back[k])
        else:
            assert back[k] == v and type(back[k]) is type(v), k
    assert isinstance(back["nested"]["t"][1], tuple)


@pytest.mark.parametrize("value", [lambda: 0, torch.zeros(1000), object(), {"f": print}])
def test_codec_refuses_what_it_cannot_rebuild(value):
    assert not json_ok(value)
    with pytest.raises(NotJSON):
        encode(value)


@pytest.mark.parametrize("tag", ["", ".", "..", "latest", ".hidden", "a/b", "a\\b", " x", 3])
def test_bad_tags(tag):
    with pytest.raises((ValueError, TypeError)):
        check_tag(tag)


def test_good_tag():
    assert check_tag("step100") == "step100"


def test_crc32_sees_every_byte_and_dtype():
    t = torch.randn(100)
    u = t.clone()
    u[57] = torch.nextafter(u[57], torch.tensor(math.inf))
    assert crc32(t) != crc32(u) and crc32(t) == crc32(t.clone())
    assert crc32(t.bfloat16()) != crc32(t.half()) and crc32(torch.zeros(0)) == 0


@pytest.mark.parametrize("start,numel,chunk", [(0, 10, 3), (5, 9, 9), (7, 1, 4), (0, 0, 4), (3, 100, 1000)])
def test_chunks_tile_the_run(start, numel, chunk):
    got = chunks(start, numel, chunk)
    covered = [i for s, n in got for i in range(s, s + n)]
    assert covered == list(range(start, start + numel)) and all(0 < n <= chunk for _, n in got)


def _saved_chunks(numel, world_size, bucket, chunk):
    """Chunks of one parameter as a save at (world_size, bucket, chunk) writes them."""
    layout = build_layout([37, numel, 11], world_size, bucket, 64)
    out = []
    for r in range(world_size):
        for piece in layout.shard_pieces(r):
            if piece.param_index == 1:
                out += [Chunk(s, n, r, (0, 0, 0)) for s, n in chunks(piece.param_offset, piece.numel, chunk)]
    return sorted(out), layout


def test_overlapping_equals_brute_force_across_layouts():
    rng = random.Random(0)
    for _ in range(200):
        numel = rng.randint(1, 3000)
        saved, _ = _saved_chunks(numel, rng.randint(1, 5), rng.randint(1, 1500), rng.randint(1, 700))
        check_tiling("p", saved, numel)
        starts = [c.start for c in saved]
        _, layout = _saved_chunks(numel, rng.randint(1, 5), rng.randint(1, 1500), 10**9)
        for r in range(layout.world_size):
            for piece in layout.shard_pieces(r):
                if piece.param_index != 1:
                    continue
                lo, hi = piece.param_offset, piece.param_offset + piece.numel
                got = overlapping(saved, starts, lo, hi)
                want = [(c, max(lo, c.start), min(hi, c.start + c.numel)) for c in saved
                        if max(lo, c.start) < min(hi, c.start + c.numel)]
                assert got == want
                assert sum(b - a for _, a, b in got) == hi - lo


def test_tiling_errors_name_the_parameter():
    with pytest.raises(CheckpointError, match="'w'.*gap at element 5"):
        check_tiling("w", [Chunk(0, 5, 0, (0, 0, 0)), Chunk(6, 4, 0, (0, 0, 0))], 10)
    with pytest.raises(CheckpointError, match="'w'.*overlap"):
        check_tiling("w", [Chunk(0, 6, 0, (0, 0, 0)), Chunk(5, 5, 0, (0, 0, 0))], 10)
    with pytest.raises(CheckpointError, match=r"\[0, 8\) of parameter 'w', which has 10"):
        check_tiling("w", [Chunk(0, 8, 0, (0, 0, 0))], 10)
    check_tiling("empty", [], 0)


def test_describe_mismatch():
    lines = describe_mismatch("parameters", {"a": (2,), "b": (3, 4), "c": (1,)}, {"b": (4, 3), "c": (1,), "d": ()})
    assert lines == ["parameters of the model missing from the checkpoint: a",
                     "parameters in the checkpoint that the model does not have: d",
                     "parameters with another shape: b (checkpoint [4, 3], model [3, 4])"]
    assert describe_mismatch("x", {"a": (1,)}, {"a": (1,)}) == []
