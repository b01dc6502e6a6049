"""The range math of resharding: saved chunks of a parameter -> any rank's shard pieces.

Pure: integers, tensors in memory and a ``read_chunk`` callback; no files, no collectives.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .errors import CheckpointError

DEFAULT_CHUNK_NUMEL = 1 << 22  # 16 MiB of fp32: the unit of reading and of crc32 checks


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def chunks(start: int, numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Split the run [start, start + numel) into (start, numel) pieces of at most ``chunk_numel``."""
    return [(s, min(chunk_numel, start + numel - s)) for s in range(start, start + numel, chunk_numel)]


class Chunk(NamedTuple):
    """One saved chunk of a parameter: elements [start, start + numel), in rank file ``file``."""

    start: int
    numel: int
    file: int
    crcs: tuple[int, ...]  # crc32 of each saved kind, in the parameter's "kinds" order

    @classmethod
    def parse(cls, row: Sequence[int]) -> Chunk:  # metadata row: [start, numel, file, crc per kind...]
        return cls(row[0], row[1], row[2], tuple(row[3:]))


def check_tiling(name: str, saved: Sequence[Chunk], numel: int) -> None:
    """The chunks (sorted by start) must cover [0, numel) exactly once."""
    end = 0
    for c in saved:
        if c.start != end or c.numel <= 0:
            raise CheckpointError(f"the saved chunks of parameter {name!r} {'overlap' if c.start < end else 'leave a gap'}"
                                  f" at element {min(end, c.start)} of {numel}: metadata.json is inconsistent")
        end = c.start + c.numel
    if end != numel:
        raise CheckpointError(f"the checkpoint holds elements [0, {end}) of parameter {name!r}, which has "
                              f"{numel}: metadata.json is inconsistent")


def overlapping(saved: Sequence[Chunk], starts: Sequence[int], lo: int, hi: int) -> list[tuple[Chunk, int, int]]:
    """(chunk, a, b) for every saved chunk meeting [lo, hi), [a, b) the intersection.

    ``saved`` tiles the parameter in order; ``starts`` are their start offsets.
    """
    out = []
    k = max(bisect.bisect_right(starts, lo) - 1, 0)
    while k < len(saved) and saved[k].start < hi:
        c = saved[k]
        a, b = max(lo, c.start), min(hi, c.start + c.numel)
        if a < b:
            out.append((c, a, b))
        k += 1
    return out


def aliases(meta: dict) -> dict[str, str]:
    """Every state-dict key of a saved parameter -> its name in the checkpoint."""
    return {n: name for name, rec in meta["params"].items() for n in [name, *rec["aliases"]]}


def reshard(view, meta: dict, read_chunk: Callable[[str, Chunk], dict],
            weights: Callable[[str], torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """New shards ({kind: tensor} per partition of this rank, ``view.index`` order) from saved chunks.

    ``read_chunk(name, chunk)`` returns the chunk's tensors by kind; each chunk is read once per
    parameter however many of this rank's pieces it meets. Padding, and a kind the checkpoint
    lacks, stay zero (check_match has refused saved kinds a partition lacks). A parameter frozen when
    saved (no state kinds) and trained now gets its master from its saved weights, ``weights(name)``.
    """
    staged = [{kind: torch.zeros(part.shard_numel, dtype=torch.float32) for kind in part.kinds} for part in view.index]
    wants: dict[str, list] = {}
    for k, part in enumerate(view.index):
        for piece in part.pieces:
            wants.setdefault(view.name(part.params[piece.param_index]), []).append((k, piece))
    alias = aliases(meta)
    for mine, pieces in wants.items():
        name = alias[mine]
        if not meta["params"][name]["kinds"] and weights is not None:  # frozen when saved: its state starts empty
            full = weights(name).reshape(-1).float()
            for k, piece in pieces:
                at = piece.shard_offset
                staged[k]["master"][at:at + piece.numel] = full[piece.param_offset:piece.param_offset + piece.numel]
            continue
        saved = [Chunk.parse(c) for c in meta["params"][name]["chunks"]]
        starts = [c.start for c in saved]
        cache: dict[int, dict[str, torch.Tensor]] = {}
        for k, piece in pieces:
            lo = piece.param_offset
            for c, a, b in overlapping(saved, starts, lo, lo + piece.numel):
                if c.start not in cache:
                    cache[c.start] = read_chunk(name, c)
                at = piece.shard_offset + a - lo
                for kind, src in cache[c.start].items():
                    staged[k][kind][at:at + b - a] = src[a - c.start:b - c.start]
    return staged
