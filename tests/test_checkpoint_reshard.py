"""fused_zero.checkpoint.reshard: the chunk and range math, against brute force."""
import random

import pytest

from fused_zero.checkpoint.errors import CheckpointError
from fused_zero.checkpoint.reshard import Chunk, check_tiling, chunks, overlapping
from fused_zero.sharding.layout import build_layout


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
