"""The only module of fused_zero that calls torch.distributed.

``Comm`` wraps one process group. Without an initialised process group, or when
the group has one rank, it runs locally: every collective is a copy or a no-op,
returns a completed ``Handle`` and counts no traffic, so a single process needs
no set-up and pays for no communication.

What the backends take (checked by tests/test_collectives.py on gloo, torch 2.13):
gloo runs reduce_scatter / all_gather into one flat tensor, all_reduce sum/max/min,
async_op, in-place all_gather (input = the rank's slice of output) and in-place
reduce_scatter (output = the rank's slice of input) for fp32, fp64, bf16 and fp16
CPU tensors. We only use SUM and leave averaging to the caller: ReduceOp.AVG fails
for integers on gloo and is not in every backend and version. What the tensors must be
(contiguous, on the backend's device) is checked first: comm/tensor_checks.py.

On gloo, a reduce-scatter of a scratch input runs as an all-reduce and an
all-gather as one broadcast per rank: both measured faster there than gloo's
own collectives (see reduce_scatter and _all_gather_by_broadcast).

Traffic is counted per rank as the ZeRO paper counts volume (comm/traffic.py).
Broadcast and object collectives are set-up only and are not counted.

Every tensor a collective is given is a pinned alias, for a clean exit (see comm/pins.py): ``_launch``
pins it, and an ``atexit`` hook here keeps the pins still held when the interpreter exits.
"""
from __future__ import annotations

import atexit
import copy
import ctypes
import pickle
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import group_pool, rendezvous
from .agreement import Agreement
from .group_meeting import digest
from .pins import _PINS, _Pin, _alias, _reap
from .tensor_checks import _DEVICE_FOR_BACKEND, TensorChecks
from .traffic import TrafficCount
from .works import _DONE, Handle, _AllWorks, _copy_local, _Watched
from ..habits import torchrun_without_process_group
from ..host_read import host_copy, to_host
from ..sharding.intervals import overlaps

# torch 2.13 renamed the flat-tensor collectives and deprecates the old names
# (FutureWarning); torch 2.11 on the GPU machines has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


#: Seconds the exit hook releases the GIL for, so that a collective's thread waiting for it can finish.
EXIT_GRACE_S = 0.05
_ranks_met = False  # a Comm over more than one rank was built in this process


@atexit.register
def _keep_pins_at_exit() -> None:
    """The interpreter is exiting: keep the pins still held for good (see comm/pins.py).

    atexit runs before finalization. One extra reference on the deque survives the clearing of
    the modules' globals, so no alias in it ever reaches a count of 1 on any thread. Collectives
    that fused_zero did not issue (a framework's loss gather, the user's own all_reduce) hand torch
    unpinned tensors; a thread finishing one of those may be waiting for the GIL right now, so while
    a process group is up the hook also lets go of the GIL for ``EXIT_GRACE_S``: a thread that
    waits for it takes it while the interpreter can still give it, instead of after.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_PINS))
    rendezvous.at_exit()
    if _ranks_met or (dist.is_available() and dist.is_initialized()):
        time.sleep(EXIT_GRACE_S)


def global_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_DESTROYED = ("torch.distributed.destroy_process_group() ran before this collective call of the "
              "ShardedOptimizer: its collective calls (a forward and backward at stage 3, step(), "
              "close(), full_parameters(), state_dict(), checkpoint.save) need the process group it was built "
              "over; make them before destroying it (at stage 3, close() first gives the model its full parameters "
              "back: its shards are spread over the ranks of that group)")


def _check_group_alive(comm: "Comm | None" = None) -> None:
    """Before a collective: torch would say "Group ... is not registered" after destroy_process_group(), or
    fail on ranks that no longer exist once a new default group was made (``comm``: the caller's group)."""
    if not dist.is_initialized():
        raise RuntimeError(_DESTROYED)
    if comm is not None and comm.world is not None and dist.group.WORLD is not comm.world:
        raise RuntimeError(_DESTROYED + "; a new init_process_group() since does not bring it back: build a new "
                           "ShardedOptimizer over the new group (fused_zero.checkpoint.load resumes at any world size)")


def default_world_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collectives_checked_on_host() -> bool:
    """Whether torch checks each collective on the host first (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every group:
    a blocking gloo exchange of the call's fingerprint before it runs)."""
    return dist.is_available() and dist.get_debug_level() == dist.DebugLevel.DETAIL


def default_store():
    """The default process group's c10d store (every rank shares it, whatever its groups), or None without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def is_process_group(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.distributed.ProcessGroup`` (what ``process_group=`` takes)."""
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


def sliced_from_larger_mesh(mesh) -> bool:
    """Whether ``mesh`` is a sub-mesh (``mesh["dp"]``) of a mesh with more ranks: other dimensions (tensor or
    pipeline parallel) whose ranks hold other slices of the model."""
    try:
        return mesh._get_root_mesh().size() > mesh.size()
    except (AttributeError, RuntimeError):  # (a torch without the private accessor: not known)
        return False


def is_device_mesh(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.distributed.device_mesh.DeviceMesh`` (comm/topology.py reads it)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without torch.distributed
        return False
    return isinstance(obj, DeviceMesh)


def _owning(group, key, number: int) -> "Comm":
    """A Comm over ``group``, a process group this package made (``Comm.spanning``, ``Comm.split``; request
    ``number`` of ``key``): when the Comm is collected (its optimizer dropped, or rebuilt in a sweep) the group
    goes back to ``group_pool`` for the next Comm over the same ranks, never destroyed (why: group_pool.py), so
    a sweep holds as many groups as the optimizers alive at once need."""
    comm = Comm(group)
    weakref.finalize(comm, group_pool.give_back, key, number, group).atexit = False
    return comm


def _registered(group) -> bool:
    """Whether torch.distributed still holds ``group`` (not taken by destroy_process_group())."""
    return dist.is_available() and dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


class Comm(TensorChecks, TrafficCount, Agreement):
    """A communicator over ``group`` (a ProcessGroup, or None for the default group)."""

    def __init__(self, group=None):
        self.group = group
        self.world = None  # the default group when built: its replacement (destroy, init again) is refused
        if dist.is_available() and dist.is_initialized():
            self.world = dist.group.WORLD
            self.rank = dist.get_rank(group)
            if self.rank < 0:
                raise ValueError(
                    "this process is not a member of the process group passed to Comm; "
                    "build the optimizer only on the group's ranks, or pass a group containing this rank"
                )
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        elif group is not None:
            raise RuntimeError("Comm was given a process group but torch.distributed is not initialised")
        elif torchrun_without_process_group() is not None:
            raise RuntimeError(torchrun_without_process_group())
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"
        self._local = self.world_size == 1
        if not self._local:
            global _ranks_met
            _ranks_met = True
        self.reset_traffic()

    def duplicate(self, backend: str | None = None) -> "Comm":
        """A Comm over a new process group with the same ranks (every rank must call it).

        Collectives are matched across ranks by their order within a group; work
        whose order depends on timing (stage 3's gathers against the reducer's
        reduce-scatters) gets a group of its own so the two never interleave.
        ``backend``: another backend for the new group ("gloo": host flags beside an NCCL group).
        """
        if self._local:  # nothing to keep apart: the same (local) communicator, own traffic count (the group, if
            twin = copy.copy(self)  # one this package made, is destroyed when this Comm goes: _owning)
            twin.reset_traffic()
            return twin
        ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        return self.spanning(ranks, backend, local=self.group is not None)

    def spanning(self, ranks: list[int], backend: str | None = None, local: bool = True) -> "Comm":
        """A Comm over a group of ``ranks`` of its own (global ranks; every rank of them must call it, and with
        ``local=False`` every rank of the default group), with this group's timeout: one that a collected Comm
        left (``group_pool``), or a new one."""
        ranks, backend = sorted(ranks), backend or self.backend
        key = ("span", tuple(ranks), backend, _group_timeout(self.group))
        group, number = group_pool.take(key, ranks, dist.get_rank(), lambda: self._new_group(ranks, backend, local),
                                        default_store(), digest(key), _registered)
        return _owning(group, key, number)

    def _new_group(self, ranks: list[int], backend: str | None, local: bool):
        """dist.new_group over ``ranks`` with this group's timeout (None on a rank outside them with ``local``)."""
        # new_group() without timeout= gets torch's default (30 min), not the user's: pass theirs.
        timeout = _group_timeout(self.group)
        return dist.new_group(ranks=sorted(ranks), backend=backend or self.backend, use_local_synchronization=local,
                              **({"timeout": timeout} if timeout is not None else {}))

    def split(self, size: int) -> "Comm":
        """A Comm over this rank's block of ``size`` consecutive ranks of this group ([0..size-1], [size..2*size-1],
        ...): every rank of the group calls it, and it calls new_group for every block in the same order."""
        if self.world_size % size:
            raise ValueError(f"a group of {self.world_size} ranks does not split into blocks of {size}")
        if self._local or size == self.world_size:
            return self.duplicate()
        ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)

        def make():
            mine = None
            for start in range(0, self.world_size, size):
                made = self._new_group(ranks[start:start + size], None, local=self.group is not None)
                if self.rank // size == start // size:
                    mine = made
            return mine
        key = ("split", tuple(ranks), size, self.backend, _group_timeout(self.group))
        group, number = group_pool.take(key, sorted(ranks), dist.get_rank(), make, default_store(), digest(key),
                                        _registered)
        return _owning(group, key, number)

    def any_rank(self, flag: bool, site: str) -> bool:
        """Whether ``flag`` is set on some rank: a blocking all-reduce of one host number (a gloo group).

        Any thread may call it (the host update's worker does, on a group of its own): its tensor lives
        as long as this Comm, so no Work ever holds the last reference to it and nothing is pinned; its
        bytes are not counted as traffic. ``site``: what the read is, for host_read's counts."""
        if self._local:
            return flag
        if self.backend != "gloo":
            raise ValueError(f"any_rank needs a gloo group (host numbers), this one is {self.backend}: "
                             "make it with duplicate(backend=\"gloo\")")
        t = self.__dict__.get("_flag")
        if t is None:
            t = self._flag = torch.zeros(1, dtype=torch.float32)
        t.fill_(float(flag))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(to_host(t[0], site))

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    def _launch(self, collective: Callable, *tensors: torch.Tensor, **kwargs):
        """``collective(*aliases, group=, async_op=True, **kwargs)`` on pinned aliases of ``tensors``; its Work."""
        _reap()
        _check_group_alive(self)
        # (from a list, not a generator: tuple(genexpr) grows the tuple in place, and a gc.get_objects() on another
        # thread (habits.ddp_reduced at a first gradient) holding it then makes CPython raise SystemError)
        aliases = tuple([_alias(t) for t in tensors])
        _PINS.append(_Pin(aliases, torch.ScriptList(list(aliases))))  # before the Work can exist
        work = collective(*aliases, group=self.group, async_op=True, **kwargs)
        return _Watched(work) if self.backend == "gloo" else work

    def rendezvous(self, ranks: list[int] | None = None) -> "rendezvous.Rendezvous | None":
        """The store-based meeting point of one optimizer's collective calls (every rank builds it); None alone.

        ``ranks``: the global ranks it spans when that is more than this group (HSDP: every rank of the mesh,
        so that a call made by one replica group alone is seen)."""
        if (self._local if ranks is None else len(ranks) == 1):
            return None
        timeout = group_timeout_s(self)
        store = default_store()
        if ranks is not None:
            ranks = sorted(ranks)
            key = digest(ranks)
            return rendezvous.Rendezvous(store, ranks.index(dist.get_rank()), len(ranks), timeout, key, ranks)
        ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)  # (in the group's rank order)
        key = "world" if self.group is None else digest(ranks)
        return rendezvous.Rendezvous(store, self.rank, self.world_size, timeout, key, ranks)

    # ---- tensor collectives -------------------------------------------------
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                       scratch_input: bool = False) -> Handle:
        """SUM of every rank's ``input``; this rank receives slice ``rank`` into ``output``.

        ``scratch_input=True`` lets the collective overwrite ``input``. On gloo it
        then runs as an all-reduce of ``input`` and a copy of this rank's slice:
        gloo's reduce_scatter takes twice as long as its all_reduce of the same
        buffer (64 MiB on 2 ranks, torch 2.13, 2-core machine: 165 ms against
        83 ms; all_reduce plus the copy 70 ms). Traffic is counted as a
        reduce-scatter either way: the ZeRO volume, not gloo's wire bytes.
        """
        self._check_pair("reduce_scatter", "input", input, "output", output)
        if self._local:
            return _copy_local(output, input)
        self._count("reduce_scatter", input)
        if scratch_input and self.backend == "gloo":
            n = output.numel()
            mine = input.view(-1)[self.rank * n:(self.rank + 1) * n]
            work = self._launch(dist.all_reduce, input, op=dist.ReduceOp.SUM)
            # in place (output is this rank's slice of input, checked above): the sum is already there
            handle = Handle(work, None if overlaps(output, input) else lambda: output.view(-1).copy_(mine))
            if not async_op:
                handle.wait()
            return handle
        # flat views: gloo checks shapes (output.shape[0] * world_size == input.shape[0]), not numels
        handle = Handle(self._launch(_reduce_scatter, output.view(-1), input.view(-1), op=dist.ReduceOp.SUM))
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   kind: str = "all_gather") -> Handle:
        """``output`` receives every rank's ``input`` in rank order (``input`` may be its own slice of it);
        its bytes are counted under ``kind``."""
        self._check_pair("all_gather", "output", output, "input", input)
        if self._local:
            return _copy_local(output, input)
        self._count(kind, output)
        if self.backend == "gloo":
            return self._all_gather_by_broadcast(output.view(-1), input.view(-1), async_op)
        handle = Handle(self._launch(_all_gather, output.view(-1), input.view(-1)))
        if not async_op:
            handle.wait()
        return handle

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   kind: str = "all_to_all") -> Handle:
        """Slice r of ``input`` goes to rank r, into slice ``rank`` of its ``output`` (equal slices; separate
        buffers); ``input``'s bytes are counted under ``kind``. gloo takes uint8 (the codecs' payloads)."""
        self._check_tensor("all_to_all input", input)
        self._check_tensor("all_to_all output", output)
        if output.shape != input.shape or output.dtype != input.dtype or input.numel() % self.world_size:
            raise ValueError(f"all_to_all needs output and input of one shape and dtype, split into world_size "
                             f"({self.world_size}) equal slices; got {tuple(output.shape)} {output.dtype} and "
                             f"{tuple(input.shape)} {input.dtype}")
        if overlaps(output, input):
            raise ValueError("all_to_all output overlaps its input: pass a separate buffer")
        if self._local:
            return _copy_local(output, input)
        self._count(kind, input)
        handle = Handle(self._launch(dist.all_to_all_single, output.view(-1), input.view(-1)))
        if not async_op:
            handle.wait()
        return handle

    def _all_gather_by_broadcast(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Handle:
        """gloo: one broadcast per rank into its slice of ``output``.

        Three times faster than gloo's all_gather (64 MiB out, torch 2.13, 2-core
        machine: 24 ms against 71 ms at 2 ranks, 60 against 190 at 4).
        """
        n = input.numel()
        own = output[self.rank * n:(self.rank + 1) * n]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        works = [self._launch(dist.broadcast, output[r * n:(r + 1) * n], src=self._global(r))
                 for r in range(self.world_size)]
        handle = Handle(_AllWorks(works))
        if not async_op:
            handle.wait()
        return handle

    def _global(self, rank: int) -> int:
        _check_group_alive(self)
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def seat(self) -> tuple[str, tuple[int, ...]]:
        """This group's name (torch names a group alike on each of its ranks) and its global ranks, in group
        order: what ``group_meeting`` compares across ranks."""
        group = self.group or dist.group.WORLD
        return (str(group.group_name), tuple(dist.get_process_group_ranks(group)))

    def global_rank_of(self, rank: int) -> int:
        """The global rank of this group's rank ``rank``."""
        return global_rank() if self._local else self._global(rank)  # (a group of one: this rank)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Handle:
        """In-place reduction over ranks; ``op`` is "sum", "max" or "min"."""
        if op not in _OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(_OPS)}, got {op!r} "
                             "(for an average: sum, then divide)")
        self._check_tensor("all_reduce tensor", tensor)
        if self._local:
            return _DONE
        self._count("all_reduce", tensor, times=2)
        handle = Handle(self._launch(dist.all_reduce, tensor, op=_OPS[op]))
        if not async_op:
            handle.wait()
        return handle

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy ``tensor`` of group rank ``src`` into ``tensor`` on every rank (synchronous)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src must be a rank of this group, 0..{self.world_size - 1}; "
                             f"got {src}")
        self._check_tensor("broadcast tensor", tensor)
        if self._local:
            return
        self._launch(dist.broadcast, tensor, src=self._global(src)).wait()

    @torch.no_grad()
    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Every rank takes rank ``src``'s values of ``tensors`` (module buffers): one broadcast per dtype."""
        if self._local or not tensors:
            return
        by_kind: dict = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in group]) if len(group) > 1 else group[0].reshape(-1).clone()
            self.broadcast(flat, src=src)
            offset = 0
            for t in group:
                # through .data, as DDP's buffer sync: pure data movement, so the version counter autograd checks
                # stays (a BatchNorm forward whose backward is still to come saved running_mean / running_var)
                t.data.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    # ---- object collectives (set-up and checks) ------------------------------
    def all_gather_object(self, obj: Any) -> list:
        """``[obj of rank 0, ..., obj of rank world_size-1]`` (pickled; on nccl through the current CUDA device).

        Runs on pinned tensors of its own rather than torch's all_gather_object, whose tensors are
        not (see comm/pins.py).
        """
        if self._local:
            return [obj]
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self._launch(_all_gather, sizes, mine).wait()
        sizes = to_host(sizes, "all_gather_object")
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data.to(device)
        out = torch.empty(self.world_size * longest, dtype=torch.uint8, device=device)
        self._launch(_all_gather, out, padded).wait()
        out = host_copy(out, "all_gather_object")
        return [pickle.loads(out[r * longest: r * longest + n].numpy().tobytes()) for r, n in enumerate(sizes)]

    def barrier(self) -> None:
        if not self._local:
            dist.barrier(group=self.group)  # no tensor of ours


def group_timeout_s(comm: "Comm") -> float | None:
    """``comm``'s group's timeout in seconds, or None where torch does not say."""
    timeout = _group_timeout(comm.group)
    return None if timeout is None else timeout.total_seconds()


def _group_timeout(group):
    """The timeout of ``group`` (or of the default group), or None where torch does not say."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        opts = pg._get_backend(torch.device(_DEVICE_FOR_BACKEND.get(str(dist.get_backend(pg)), "cpu"))).options
        return opts._timeout
    except (AttributeError, RuntimeError, ImportError):
        return None
