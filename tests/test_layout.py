"""fused_zero.sharding.layout against brute-force element-by-element oracles."""
import random

import pytest

from fused_zero.sharding.layout import build_layout

CASES = [
    # (numels, world_size, bucket_numel, align)
    ([1], 1, 1, 64),
    ([1], 4, 1, 64),
    ([4096, 4096], 2, 1000, 64),  # buckets split parameters
    ([63, 65, 1, 127, 0, 129], 3, 256, 64),  # odd sizes, a zero-size param
    ([7, 11, 13, 17, 19, 23], 4, 64, 64),  # primes, bucket of one unit per rank
    ([100_003], 3, 1 << 24, 64),  # one bucket larger than everything
    ([], 2, 128, 64),  # empty group
    ([0, 0], 2, 128, 64),
]


def random_cases(seed=0, count=40):
    rng = random.Random(seed)
    for _ in range(count):
        numels = [rng.choice([0, 1, 2, 63, 64, 65, rng.randrange(1, 5000)]) for _ in range(rng.randrange(1, 12))]
        yield numels, rng.randrange(1, 5), rng.randrange(1, 3000), rng.choice([1, 8, 64])


def owner_of(layout, flat):
    """(rank, shard element) holding flat element ``flat``, by brute force."""
    for b in layout.buckets:
        for r in range(layout.world_size):
            lo, hi = layout.shard_range(b, r)
            if lo <= flat < hi:
                return r, b.shard_offset + flat - lo
    raise AssertionError(f"flat element {flat} is in no shard")


@pytest.mark.parametrize("numels,world_size,bucket_numel,align", CASES + list(random_cases()))
def test_layout_invariants(numels, world_size, bucket_numel, align):
    layout = build_layout(numels, world_size, bucket_numel, align)
    unit = align * world_size
    # Slots: in order, aligned, not overlapping.
    end = 0
    for i, (slot, n) in enumerate(zip(layout.slots, numels)):
        assert slot.index == i and slot.numel == n
        assert slot.offset % align == 0 and slot.offset >= end
        end = slot.offset + n if n else end
    # Buckets: contiguous, cover everything, constant size but the last, splittable.
    assert layout.numel >= end and layout.numel % unit == 0
    assert layout.numel - end < unit
    size = layout.buckets[0].numel if layout.buckets else 0
    offset = shard_offset = 0
    for k, b in enumerate(layout.buckets):
        assert (b.index, b.offset, b.shard_offset) == (k, offset, shard_offset)
        assert b.numel % unit == 0 and b.shard_numel * world_size == b.numel
        assert b.numel == size if k < len(layout.buckets) - 1 else 0 < b.numel <= size
        assert size >= bucket_numel or len(layout.buckets) == 1
        offset += b.numel
        shard_offset += b.shard_numel
    assert offset == layout.numel and shard_offset == layout.shard_numel
    assert layout.shard_numel * world_size == layout.numel
    # Every parameter element sits exactly once in exactly one rank's shard, where shard_pieces says.
    seen = {}
    for r in range(world_size):
        for piece in layout.shard_pieces(r):
            slot = layout.slots[piece.param_index]
            for j in range(piece.numel):
                flat = slot.offset + piece.param_offset + j
                assert owner_of(layout, flat) == (r, piece.shard_offset + j)
                key = (piece.param_index, piece.param_offset + j)
                assert key not in seen
                seen[key] = r
    assert len(seen) == sum(numels)
    # Bucket <-> parameter membership.
    for slot in layout.slots:
        expected = {k for k, b in enumerate(layout.buckets) for f in range(slot.offset, slot.offset + slot.numel)
                    if b.offset <= f < b.offset + b.numel}
        assert set(layout.buckets_of_param(slot.index)) == expected
        for k in range(len(layout.buckets)):
            assert (slot.index in layout.params_of_bucket(k)) == (k in expected)


def test_bucket_size_rounds_up_to_world_size_times_align():
    layout = build_layout([1000], world_size=3, bucket_numel=100, align=64)
    assert [b.numel for b in layout.buckets] == [192] * 6  # 1000 -> 1152 = 6 * 192
    assert layout.shard_numel == 384


@pytest.mark.parametrize("args,match", [
    (([1], 0, 8), "world_size"),
    (([1], 1, 0), "bucket_numel"),
    (([-1], 1, 8), "negative"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        build_layout(*args)
