"""Sharding: which element lives where, and the memory a (param group, dtype) lives in.

- ``layout.py``: pure index math; parameters -> 64-element-aligned offsets of one flat buffer,
  cut into constant-size buckets, each split into world-size equal shards.
- ``intervals.py``: the half-open interval helpers the layout and the collectives share.
- ``units.py``: stage 3's units (which modules are gathered together).
- ``partition.py``: a ``Partition``, the flat buffer, the reduced-gradient shard and its tier's
  stores (``tiers/``) of one layout, and the parameters as views of it.
"""
