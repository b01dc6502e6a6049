"""Topology: which process group each of the optimizer's collectives uses, from ``process_group=`` or ``mesh=``.

- neither: the default process group (a single rank without one);
- ``process_group=g``: shard over ``g``;
- ``mesh=m``, a 1-D ``DeviceMesh``, or the data-parallel sub-mesh of a larger one (``mesh["dp"]`` of a
  tp x dp mesh, as the ZeRO paper's 3-D example runs ZeRO on the data-parallel dimension): shard
  over its group, as ``process_group=m.get_group()`` would;
- a 2-D mesh named ("replicate", "shard") is hybrid sharding (HSDP, FSDP2's 2-D mesh): every ZeRO
  collective runs inside the "shard" group, and the reduced gradient shards are all-reduced over the
  "replicate" group (``replicate``); what every rank must share (the initial values, the module
  buffers, the build's agreement checks, the step's stats and verdicts) spans both levels;
- any other mesh refused, naming the data-parallel sub-mesh to pass;
- ``secondary_shard=s`` (stage 3's hpZ, with a flat shard group): the shard group cut into blocks of ``s``
  consecutive ranks standing for nodes (``secondary``: backward's gathers run inside a block). Refused with an
  HSDP mesh (its shard group already is a node: every gather stays inside it) and when ``s`` does not divide
  the shard group's size.

Every check here is local (each rank holds its own mesh object); then ``meet`` compares every rank's groups and
mesh through the default group's store (comm/group_meeting.py), before any collective: ranks given another mesh
(shape or dimension names), a mesh on some ranks only, or another group raise on every rank rather than wait in
collectives over groups that never pair. The groups of the optimizer's own (stage 3's gathers,
``state_dict()``'s control group, the host update's verdicts) are made by ``own_group``: nothing else
builds process groups.
"""
from __future__ import annotations

from .agreement import _error_class, raise_if_differ
from .collectives import (Comm, default_store, global_rank, group_timeout_s, is_device_mesh, is_process_group,
                          sliced_from_larger_mesh)
from .group_meeting import meet, seat_of

HSDP_DIMS = ("replicate", "shard")


def refuse_build(error: Exception, process_group=None, mesh=None) -> None:
    """A build refused on this rank before it met the other ranks (a bad argument here alone): tell them through
    the store, over the topology they wait at (the one given, else the default group's), so that they raise
    ``error``'s reason rather than wait for this rank until the timeout."""
    if default_store() is None:
        return
    try:
        topology = Topology(process_group, mesh)
    except (ValueError, TypeError, RuntimeError):  # the groups given were the bad argument: the default group's
        topology = Topology()
    topology.meet(refused=error)


class Topology:
    """The optimizer's communicators: ``shard`` (every collective of the ZeRO stages) and its own groups."""

    def __init__(self, process_group=None, mesh=None, secondary_shard: int | None = None) -> None:
        self.mesh = mesh
        self.replicate: Comm | None = None  # HSDP: the group of this rank's replicas (same shard, other groups)
        self._replicate_again: Comm | None = None  # HSDP with qgZ: a second group of them (replicate_again)
        if process_group is not None and not is_process_group(process_group):
            raise TypeError(
                f"process_group must be a torch.distributed ProcessGroup (dist.new_group(...), mesh.get_group()) or "
                f"None, got {type(process_group).__name__}" + (
                    ": a DeviceMesh goes to mesh= (a 1-D one, or a 2-D one named ('replicate', 'shard') for HSDP)"
                    if is_device_mesh(process_group) else ""))
        if mesh is not None:
            process_group = self._group_of(mesh, process_group)
            if mesh.ndim == 2:
                self.replicate = Comm(mesh.get_group("replicate"))
                if self.replicate.world_size == 1:
                    self.replicate = None
        self.shard = Comm(process_group)
        #: a data-parallel sub-mesh of a larger mesh (tp x dp): a norm over these groups misses the other dims' shares
        self.model_parallel = mesh is not None and sliced_from_larger_mesh(mesh)
        #: every rank that trains the model: the shard group's size times the replicas'
        self.world_size = self.shard.world_size * (self.replicate.world_size if self.replicate else 1)
        self.secondary_shard = secondary_shard
        self._check_secondary()

    def _check_secondary(self) -> None:
        """hpZ's group size fits this topology (a local check: every rank raises alike, before any collective)."""
        s, n = self.secondary_shard, self.shard.world_size
        if s is None:
            return
        if self.replicate is not None:
            raise ValueError(f"secondary_shard={s} with a {HSDP_DIMS} mesh: hybrid sharding's shard group already "
                             "is a node, so every all-gather stays inside it; pass either the 2-D mesh (HSDP) or "
                             "a 1-D mesh / process group with secondary_shard (hpZ), not both")
        if n % s:
            raise ValueError(f"secondary_shard={s} does not divide the shard group's {n} ranks: pass the ranks per "
                             f"node, a divisor of {n} that is >= 2, or None")

    def secondary(self) -> Comm:
        """hpZ: a new group over this rank's block of ``secondary_shard`` consecutive shard-group ranks (every rank
        of the shard group calls it; new_group runs for every block, in the same order on every rank)."""
        if self.secondary_shard is None:
            raise RuntimeError("secondary() needs secondary_shard= (hpZ)")
        return self.shard.split(self.secondary_shard)

    @staticmethod
    def _group_of(mesh, process_group):
        if process_group is not None:
            raise ValueError("pass either process_group= or mesh=, not both (a 1-D mesh's group is "
                             "mesh.get_group())")
        if not is_device_mesh(mesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        ranks = mesh.mesh.flatten().tolist()  # host tensor: the mesh's table of global ranks
        if global_rank() not in ranks:
            raise ValueError(f"mesh spans ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''}, not this rank "
                             f"({global_rank()}): build the optimizer on the ranks of its mesh only (each rank "
                             "passes the mesh it belongs to)")
        if mesh.ndim == 1:
            return mesh.get_group()
        if mesh.ndim == 2 and names == HSDP_DIMS:
            return mesh.get_group("shard")
        raise ValueError(
            f"mesh has {mesh.ndim} dimensions {names or '(unnamed)'}: pass the data-parallel sub-mesh the optimizer "
            "shards over, a 1-D mesh such as mesh[\"dp\"] of a (\"tp\", \"dp\") mesh, or a 2-D mesh named "
            f"{HSDP_DIMS} for hybrid sharding")

    def check_device(self, device) -> None:
        """The mesh's device type is the parameters' (a CUDA mesh over CPU parameters cannot carry them)."""
        if self.mesh is not None and self.mesh.device_type != device.type:
            raise ValueError(f"mesh is a {self.mesh.device_type!r} mesh but the parameters are on {device.type}: "
                             f"build the mesh with init_device_mesh({device.type!r}, ...), or move the model")

    def meet(self, refused: Exception | None = None) -> None:
        """Every rank of both levels was given the same groups and mesh, checked through the default group's store
        before any collective (comm/group_meeting.py): raises ValueError on each of them if not. ``refused``: this
        rank refused the build (raised ``refused`` before it met the others): the others raise it too."""
        store = default_store()
        if store is None:
            return
        shard = self.shard.seat()
        if self.replicate is None:
            span, groups, layout = tuple(sorted(shard[1])), [("shard", [shard[1]])], shard[1]
        else:
            table = self.mesh.mesh.tolist()  # host tensor: the mesh's table of global ranks (replicate x shard)
            span = tuple(sorted(r for row in table for r in row))
            groups = [("shard", [tuple(row) for row in table]), ("replicate", [tuple(col) for col in zip(*table)])]
            layout = table
        seat = seat_of(shard, None if self.replicate is None else self.replicate.seat(), self.describe(),
                       self.shard.group is None, layout)
        if refused is not None:
            seat = seat._replace(refused=(_error_class(refused, ()), str(refused)))
        meet(store, global_rank(), seat, span, groups, group_timeout_s(self.shard))

    def describe(self) -> tuple:
        """What every rank of the group must agree on (the mesh's shape and dimension names)."""
        if self.mesh is None:
            return ()
        return (self.mesh.device_type, tuple(self.mesh.shape), tuple(self.mesh.mesh_dim_names or ()))

    def span(self) -> tuple[int, ...]:
        """The global ranks of both levels, sorted: every rank that shares this optimizer's verdicts (its clip norm)."""
        if self.replicate is not None:
            return tuple(sorted(self.mesh.mesh.flatten().tolist()))  # host tensor: the mesh's table of ranks
        if self.shard.world_size == 1:
            return (global_rank(),)
        return tuple(sorted(self.shard.seat()[1]))

    def all_reduce(self, tensor, op: str = "sum") -> None:
        """Reduce ``tensor`` over every rank of both levels (inside the shard group, then over the replicas)."""
        if self.shard.world_size > 1:
            self.shard.all_reduce(tensor, op=op)
        if self.replicate is not None:
            self.replicate.all_reduce(tensor, op=op)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank of either level (every rank gets the same answer)."""
        flag = any(self.shard.agree(lambda: flag, share=bool)[1]) if self.shard.world_size > 1 else flag
        if self.replicate is not None:
            flag = any(self.replicate.agree(lambda: flag, share=bool)[1])
        return flag

    def separate_replicas(self) -> None:
        """HSDP: the replicas' all-reduces go over groups of this optimizer's own from now on (every rank calls
        it, as ``own_group``): a second optimizer over the same mesh launches them as its buckets land, on a
        schedule that moves with timing, so sharing a group would interleave the two differently on different
        ranks."""
        if self.replicate is not None:
            self.replicate = self.replicate.duplicate()
            self._replicate_again = None  # (made again from the new group when qgZ asks)

    def replicate_again(self) -> Comm | None:
        """HSDP: a second group over this rank's replicas (made at the first call, which every rank makes), for
        the second exchange of qgZ's all-reduce over them (comm/codec.py's ``TwoPhase``); None without HSDP."""
        if self.replicate is not None and self._replicate_again is None:
            self._replicate_again = self.replicate.duplicate()
        return self._replicate_again

    def replicate_traffic(self) -> dict[str, int]:
        """HSDP: the bytes sent over the replicas' groups since the last call (then reset); {} without HSDP."""
        total: dict[str, int] = {}
        for comm in (self.replicate, self._replicate_again):
            if comm is not None:
                for kind, n in comm.traffic().items():
                    total[kind] = total.get(kind, 0) + n
                comm.reset_traffic()
        return total

    def own_group(self, backend: str | None = None) -> Comm:
        """A new group over the shard group's ranks, for work of its own (every rank must call it)."""
        return self.shard.duplicate(backend)

    def rendezvous(self):
        """The meeting point of the optimizer's collective calls (comm/rendezvous.py) over every rank of both levels:
        with HSDP, a call made on one replica group alone (rank 0's load_state_dict()) is refused there instead of
        leaving the replicas apart; None alone."""
        if self.replicate is None:
            return self.shard.rendezvous()
        return self.shard.rendezvous(self.mesh.mesh.flatten().tolist())  # host tensor: the mesh's table of ranks

    def everyone(self, backend: str | None = None) -> Comm:
        """A new group over every rank of the topology (both levels), for verdicts all of them must share."""
        if self.replicate is None:
            return self.shard.duplicate(backend)
        ranks = self.mesh.mesh.flatten().tolist()  # host tensor: the mesh's table of global ranks
        return self.shard.spanning(ranks, backend)

    # -- what spans both levels -----------------------------------------------
    def broadcast(self, tensor, src: int = 0) -> None:
        """Rank 0's ``tensor`` on every rank: over the replicas, then inside the shard group."""
        if self.replicate is not None:
            self.replicate.broadcast(tensor, src=src)
        self.shard.broadcast(tensor, src=src)

    def broadcast_coalesced(self, tensors) -> None:
        if self.replicate is not None:
            self.replicate.broadcast_coalesced(tensors)
        self.shard.broadcast_coalesced(tensors)

    def check_same(self, value, what: str, hint: str = "") -> None:
        """Every rank of both levels holds the same ``value`` (else every rank of both raises, naming ``what`` and
        the first differing rank by its global rank). With HSDP every rank gathers every rank's value, over its
        shard group then over its replicas, and compares them all: a verdict reached inside one shard group
        alone would leave the others waiting in the replicas' check."""
        if self.replicate is None:
            self.shard.check_same(value, what, hint=hint)
            return
        _, row = self.shard.agree(lambda: value, share=lambda v: v)  # joins a peer's flat check_same alike
        row = [(self.shard.global_rank_of(i), v) for i, v in enumerate(row)]
        _, rows = self.replicate.agree(lambda: row, share=lambda v: v)
        raise_if_differ(sorted((pair for r in rows for pair in r), key=lambda pair: pair[0]), what, hint)

    def agree(self, fn):
        """``fn()`` on every rank, and its result; if it raises on one, it raises on every rank of both levels."""
        if self.replicate is None:
            return self.shard.agree(fn)[0]
        return self.replicate.agree(lambda: self.shard.agree(fn)[0])[0]
