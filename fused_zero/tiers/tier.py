"""Tier: where a piece of a partition's memory lives. The one vocabulary of the offload tiers."""
from __future__ import annotations

import enum


class Tier(enum.Enum):
    """``DEVICE`` beside the parameters, ``HOST`` in host memory, ``NVME`` in a scratch file.

    The value is the key ``ShardedOptimizer.memory_bytes()`` counts an offloaded tier under.
    """

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @classmethod
    def of(cls, option: str | None) -> Tier:
        """The tier a ZeroConfig offload option names (``None``, ``"cpu"``, ``"nvme"``; config.py checks them)."""
        return {None: cls.DEVICE, "cpu": cls.HOST, "nvme": cls.NVME}[option]
