"""Configuration of ShardedOptimizer as a frozen dataclass, and the constants the runtime and the planner
(``plan/``) share: the planner predicts ``memory_bytes()`` from these without importing the runtime."""
from __future__ import annotations

import numbers
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy
import torch

from .user_frames import user_stacklevel

#: Every parameter starts at a multiple of this many elements in its flat
#: buffer, and every bucket is a multiple of ``ALIGN * world_size``.
#: The chunk-edge rule: wherever the update is cut into runs (a bucket edge, an offload chunk, an
#: NVMe block: ``tiers.staging.whole_lanes``), the cut falls on a multiple of ALIGN, so each element
#: stays in the same vector lane of torch's fused CPU AdamW and the cut update is bitwise the uncut one.
ALIGN = 64

#: Gradient bucket buffers in flight per reduction dtype (comm/grad_buckets.py's BucketPipe pool).
MAX_INFLIGHT = 2

#: Scalars of step()'s all-reduce before the per-parameter has-grad flags (stats.py): sq_norm, nonfinite,
#: and the checksum's (c1, c1**2, c2, c2**2).
STATS_HEAD = 2 + 4

#: The communication codecs (``ZeroConfig.param_comm`` / ``grad_comm``, comm/codec.py): bits per value.
CODECS = {"int8": 8, "int4": 4}


def quant_words(n: int, bits: int) -> int:
    """4-byte words of the quantized values of one chunk of ``n`` elements (int8 one byte each, int4 two a byte)."""
    return -(-(n if bits == 8 else -(-n // 2)) // 4)


def payload_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of one chunk of ``n`` elements encoded (ops/quant.py): the values, padded to 4 bytes, and an fp32 scale
    per block of ``block`` elements. Pure integer math: the runtime and the planner (``plan/``) both count by it."""
    return 4 * (quant_words(n, bits) + -(-n // block))


class StageTraits(NamedTuple):
    """What a ZeRO stage shards: the one table of stage facts. ``stages.py``'s strategies take theirs from it,
    and the planner (``plan/``) models, names and recommends each stage by them; stage 0 is DDP (nothing
    sharded). The table lists the stages from the one that shards least to the one that shards most."""

    shards_states: bool  # fp32 master and moments: this rank's shard only
    shards_grads: bool  # each bucket reduce-scattered in backward, .grad freed once packed
    shards_params: bool  # parameters gathered per unit just in time, released after use
    alias: str = ""  # the other name the planner shows the stage by ("DDP")
    versus: int | None = None  # the stage the planner's recommendation of this one weighs it against


STAGE_TRAITS = {0: StageTraits(False, False, False, alias="DDP"), 1: StageTraits(True, False, False, versus=0),
                2: StageTraits(True, True, False, versus=0), 3: StageTraits(True, True, True, versus=2)}

_REDUCE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ZeroConfig:
    """How ShardedOptimizer shards, buckets and reduces.

    stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.
    bucket_numel: elements per communication bucket (before it is split into
        ``world_size`` equal shards); parameters may straddle buckets.
    reduce_dtype: dtype of gradient reduction; None reduces in the
        gradients' own dtype (as DDP does).
    adam_w_mode: True for decoupled weight decay (AdamW), False for L2 (Adam).
    max_grad_norm: clip the global gradient norm to this value in step();
        None does not clip.
    overlap: launch each bucket's reduce-scatter during backward as soon as
        it is complete (stages 2 and 3); False starts every bucket at the end
        of each backward instead.
    max_live_units: stage 3: prefetch a unit's parameters only while fewer
        than this many units (besides the root) are gathered.
    min_unit_numel: stage 3 with the default units: consecutive units holding fewer
        elements than this are merged into one (model order) until each holds at least
        this many, since every unit costs host work and collectives per gather whatever
        its size (DeepSpeed keeps such small parameters gathered; FSDP2 users stop
        wrapping small modules). The default, 2**20, leaves units of a billion-parameter
        model's size alone and merges a model of small blocks into few units (into the
        root unit where they all merge into one); 0 keeps one unit per module. Units passed with ``units=`` are never merged.
    reshard_after_forward: stage 3: release each unit's parameters after its
        forward and gather them again for its backward (False keeps them
        from forward until the unit's backward is done: less traffic, more
        memory).
    secondary_shard: stage 3 hierarchical partitioning (ZeRO++'s hpZ, DeepSpeed's
        ``zero_hpz_partition_size``): None (off), or a group size s >= 2 that divides the
        shard group's size; consecutive ranks [0..s-1], [s..2s-1], ... stand for nodes. When a
        unit is released after its forward each rank keeps its 1/s slice of the gathered unit
        (memory_bytes()'s "secondary"), and the unit's backward all-gathers inside those s
        ranks only (comm_bytes()'s "secondary_all_gather"): backward's gathers never cross a
        node. Needs reshard_after_forward=True (False gathers nothing in backward).
    offload_optimizer: where the fp32 master, exp_avg and exp_avg_sq of this
        rank's shard live and the update runs: None (beside the parameters),
        "cpu" (host memory) or "nvme" (files under ``nvme_path``).
    offload_params: stage 3: where the narrow param shard each rank keeps between
        gathers lives: None (beside the parameters), "cpu" (host memory) or
        "nvme" (a file under ``nvme_path``); brought back for each gather.
    nvme_path: the folder for ``offload_optimizer="nvme"`` and
        ``offload_params="nvme"`` (checked writable when the optimizer is built).
    offload_chunk_numel: elements per staged chunk of the offloaded states
        (host staging memory is a few chunks per state kind).
    update_behind: stages 1-2, the model given: what follows the update runs behind ``step()``, bucket by
        bucket, overlapping the next forward, each module's forward waiting for its own parameters' buckets
        (behind_buckets.py). On more than one rank, the all-gather of the updated parameters
        (gathers_behind.py; Megatron's overlap_param_gather); with ``offload_optimizer`` and the
        parameters on a GPU, the host update too. Until its module's next forward a parameter is an empty
        placeholder, so code that reads or writes ``p`` right after ``step()`` (an EMA, ``p.data.clamp_()``)
        must wait inside ``optimizer.full_parameters()`` first; hence off by default. Stage 3 always
        overlaps where it can.
    broadcast_buffers: when the optimizer is given the model, every rank takes rank 0's
        module buffers (BatchNorm statistics) before each forward, as DDP does with its default
        ``broadcast_buffers=True`` (DDP skips the forward after one under ``no_sync()`` or without
        gradients; so does this) and when the optimizer is built; False leaves them per rank
        throughout, as DDP(broadcast_buffers=False) does.
        Without the model (``model.parameters()`` at stages 1-2) buffers are never touched.
    param_comm: stage 3: None gathers the parameters as they are; "int8" (ZeRO++'s qwZ) sends each
        rank's param shard block-wise quantized (int8 and an fp32 scale per ``quant_block`` values:
        about half the bytes of bf16) and every rank computes with the dequantized values; the fp32
        master stays exact. ``full_parameters()`` and checkpoints gather exactly.
    grad_comm: None reduces gradients in ``reduce_dtype``; "int8" or "int4" (ZeRO++'s qgZ) replaces each
        bucket's reduce-scatter by a quantized all-to-all whose pieces every rank sums in fp32 in rank
        order (and, with HSDP, the replicas' all-reduce by two quantized exchanges: comm/codec.py's TwoPhase).
    quant_block: values per fp32 scale of both codecs, a power of two from 32 to 8192.
    nvme_direct: ``offload_optimizer="nvme"``: stream the state files with
        O_DIRECT, bypassing the page cache (every step then reads and writes
        the whole state from the disk); False goes through the page cache,
        which serves states that fit in free memory from RAM. Checked when
        built: a file system without O_DIRECT (tmpfs) is refused.
    """

    stage: int = 2
    bucket_numel: int = 1 << 24
    reduce_dtype: torch.dtype | None = None
    adam_w_mode: bool = True
    max_grad_norm: float | None = None
    overlap: bool = True
    max_live_units: int = 2
    min_unit_numel: int = 1 << 20
    reshard_after_forward: bool = True
    secondary_shard: int | None = None
    offload_optimizer: str | None = None
    offload_params: str | None = None
    nvme_path: str | None = None
    offload_chunk_numel: int = 1 << 20
    nvme_direct: bool = False
    update_behind: bool = False
    broadcast_buffers: bool = True
    param_comm: str | None = None
    grad_comm: str | None = None
    quant_block: int = 256

    @property
    def needs_module(self) -> bool:
        """Whether the optimizer must be given the model itself (stage 3 shards its parameters)."""
        return STAGE_TRAITS[self.stage].shards_params

    @property
    def on_disk(self) -> bool:
        """Whether a tier lives in NVMe files, whose writes can fail on one rank (an I/O error): the update and a
        load then agree across ranks before anything commits."""
        return "nvme" in (self.offload_optimizer, self.offload_params)

    @staticmethod
    def resolve(config: "ZeroConfig | None", given: dict) -> "ZeroConfig":
        """ShardedOptimizer's ``config=`` or its keyword options ``given`` (never both, so they cannot mix silently)."""
        if config is None:
            return ZeroConfig(**given)
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a fused_zero.ZeroConfig, got {type(config).__name__}")
        if given:
            raise ValueError(f"pass either config= or the keyword options ({', '.join(sorted(given))}=...), not "
                             "both: use dataclasses.replace(config, ...) to change a config")
        return config

    def _flag(self, name: str) -> None:
        """A True/False option: a bool (numpy's too), never a truthy string such as "False" from a config file."""
        value = getattr(self, name)
        if isinstance(value, numpy.bool_):
            object.__setattr__(self, name, bool(value))
        elif not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")

    def _whole(self, name: str) -> bool:
        """Whether an integer option is a whole number (numpy's too, never a bool); it is kept as an int."""
        value = getattr(self, name)
        if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Integral):
            return False
        object.__setattr__(self, name, int(value))
        return True

    def _choice(self, name: str, choices: tuple, what: str = "") -> None:
        """A string option: None or one of ``choices`` (numpy's str kept as a str). Any other type is a TypeError
        naming the accepted values: a numpy array or tensor compared with ``in`` raised numpy's "truth value of an
        array ... is ambiguous" before."""
        value = getattr(self, name)
        accepted = " or ".join((", ".join(["None"] + [f'"{c}"' for c in choices[:-1]]), f'"{choices[-1]}"'))
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be {accepted}{what}, got {type(value).__name__} {value!r}: give one of "
                            "these strings, or None")
        if value is not None and value not in choices:
            raise ValueError(f"{name} must be {accepted}{what}, got {value!r}")
        if value is not None:
            object.__setattr__(self, name, str(value))

    def __post_init__(self) -> None:
        for flag in ("adam_w_mode", "overlap", "reshard_after_forward", "broadcast_buffers", "nvme_direct",
                     "update_behind"):
            self._flag(flag)
        if not self._whole("stage") or self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        if not self._whole("bucket_numel") or self.bucket_numel < 1:
            raise ValueError(
                f"bucket_numel must be a positive int, got {self.bucket_numel!r}"
            )
        if not (self.reduce_dtype is None or isinstance(self.reduce_dtype, torch.dtype)) \
                or self.reduce_dtype not in _REDUCE_DTYPES:
            raise TypeError(
                "reduce_dtype must be None, torch.float32, torch.bfloat16 or "
                f"torch.float16, got {self.reduce_dtype!r}"
            )
        if not self._whole("max_live_units") or self.max_live_units < 1:
            raise ValueError(f"max_live_units must be an int >= 1, got {self.max_live_units!r}")
        if not self._whole("min_unit_numel") or self.min_unit_numel < 0:
            raise ValueError(f"min_unit_numel must be an int >= 0 (0: one stage-3 unit per module), "
                             f"got {self.min_unit_numel!r}")
        self._check_secondary_shard()
        self._choice("offload_optimizer", ("cpu", "nvme"))
        self._choice("offload_params", ("cpu", "nvme"))
        if self.offload_params is not None and self.stage != 3:
            raise ValueError(f"offload_params={self.offload_params!r} needs stage=3 (stages 1-2 keep every "
                             f"parameter whole on every rank; got stage={self.stage}): pass stage=3 and the model, "
                             'or offload_optimizer="cpu"/"nvme" to move the optimizer states at this stage')
        path = self.nvme_path
        if path is not None and (not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes)):
            raise TypeError(f"nvme_path must be a folder given as a str or pathlib.Path, got {path!r}")
        for option in ("offload_optimizer", "offload_params"):
            if getattr(self, option) == "nvme" and self.nvme_path is None:
                raise ValueError(f'{option}="nvme" needs nvme_path=, a folder on a fast local disk')
        if self.nvme_path is not None and "nvme" not in (self.offload_optimizer, self.offload_params):
            warnings.warn(f"nvme_path={os.fspath(self.nvme_path)!r} is unused: offload_optimizer="
                          f"{self.offload_optimizer!r} and offload_params={self.offload_params!r} keep nothing on "
                          'NVMe; pass offload_optimizer="nvme" (or offload_params="nvme") to use it, or drop nvme_path',
                          UserWarning, stacklevel=user_stacklevel())
        if self.nvme_direct and self.offload_optimizer != "nvme":
            raise ValueError('nvme_direct=True applies to offload_optimizer="nvme" (the state files); got '
                             f"offload_optimizer={self.offload_optimizer!r}: pass offload_optimizer=\"nvme\", "
                             "or drop nvme_direct")
        if self.update_behind and self.stage == 3:
            raise ValueError("update_behind=True runs stages 1-2's parameter all-gather (and offloaded update) behind "
                             "step(); stage 3 already gathers each unit before its forward and overlaps an offloaded "
                             "update by itself: drop update_behind, or use stage 1 or 2")
        if not self._whole("offload_chunk_numel") or self.offload_chunk_numel < 1:
            raise ValueError(f"offload_chunk_numel must be a positive int, got {self.offload_chunk_numel!r}")
        self._check_codecs()
        if self.max_grad_norm is not None and (isinstance(self.max_grad_norm, bool)
                                               or not isinstance(self.max_grad_norm, numbers.Real)):
            raise TypeError(f"max_grad_norm must be a positive number or None, got {self.max_grad_norm!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"max_grad_norm must be positive or None, got {self.max_grad_norm!r}"
            )

    def _check_secondary_shard(self) -> None:
        """hpZ's group size: an int >= 2, at stage 3, with the units released after forward."""
        s = self.secondary_shard
        if s is None:
            return
        if not self._whole("secondary_shard"):
            raise TypeError(f"secondary_shard must be an int (ranks per node, e.g. 8) or None, got {s!r}")
        s = self.secondary_shard
        if s < 2:
            raise ValueError(f"secondary_shard must be >= 2 (the ranks of one node), got {s}: pass None to turn "
                             "hierarchical partitioning off")
        if not STAGE_TRAITS[self.stage].shards_params:
            raise ValueError(f"secondary_shard={s} needs stage=3 (it keeps a node-local copy of the parameters "
                             f"stage 3 shards; got stage={self.stage}): pass stage=3 and the model, or drop "
                             "secondary_shard")
        if not self.reshard_after_forward:
            raise ValueError(f"secondary_shard={s} with reshard_after_forward=False: the units stay gathered from "
                             "forward to backward, so backward gathers nothing for a node-local copy to serve; "
                             "drop secondary_shard, or pass reshard_after_forward=True")

    def _check_codecs(self) -> None:
        """param_comm / grad_comm / quant_block (comm/codec.py)."""
        self._choice("param_comm", ("int8",), " (qwZ)")
        if self.param_comm is not None and self.stage != 3:
            raise ValueError(f"param_comm={self.param_comm!r} quantizes stage 3's parameter all-gathers (ZeRO++'s "
                             f"qwZ); stages 1-2 gather once per step into every rank's only copy of the parameters "
                             f"(got stage={self.stage}): pass stage=3 and the model, or drop param_comm "
                             '(grad_comm="int8" serves every stage)')
        self._choice("grad_comm", ("int8", "int4"), " (qgZ)")
        block = self.quant_block
        if not self._whole("quant_block") or not 32 <= self.quant_block <= 8192 or block & (block - 1):
            raise ValueError(f"quant_block must be a power of two from 32 to 8192 (values per fp32 scale), "
                             f"got {block!r}")
