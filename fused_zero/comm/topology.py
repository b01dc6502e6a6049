"""Topology: which process group each of the optimizer's collectives uses, from ``process_group=`` or ``mesh=``.

- neither: the default process group (a single rank without one);
- ``process_group=g``: shard over ``g``;
- ``mesh=m``, a 1-D ``DeviceMesh``, or the data-parallel sub-mesh of a larger one (``mesh["dp"]`` of a
  tp x dp mesh, as the ZeRO paper's 3-D example runs ZeRO on the data-parallel dimension): shard
  over its group, as ``process_group=m.get_group()`` would;
- a 2-D mesh named ("replicate", "shard") asks for hybrid sharding (HSDP: shard inside each group,
  replicate across them), which is not built yet: refused, naming what works today;
- any other mesh refused, naming the data-parallel sub-mesh to pass.

Every check here is local (each rank holds its own mesh object); the optimizer then checks that the
ranks of the group agree on ``describe()`` with its other options, so a rank given another mesh shape
raises on every rank, before any other collective. The groups of the optimizer's own (stage 3's gathers,
``state_dict()``'s control group, the host update's verdicts) are made by ``own_group``: nothing else
builds process groups.
"""
from __future__ import annotations

from .collectives import Comm, is_device_mesh

HSDP_DIMS = ("replicate", "shard")


class Topology:
    """The optimizer's communicators: ``shard`` (every collective of the ZeRO stages) and its own groups."""

    def __init__(self, process_group=None, mesh=None) -> None:
        self.mesh = mesh
        if mesh is not None:
            process_group = self._group_of(mesh, process_group)
        self.shard = Comm(process_group)

    @staticmethod
    def _group_of(mesh, process_group):
        if process_group is not None:
            raise ValueError("pass either process_group= or mesh=, not both (a 1-D mesh's group is "
                             "mesh.get_group())")
        if not is_device_mesh(mesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            return mesh.get_group()
        if mesh.ndim == 2 and names == HSDP_DIMS:
            raise ValueError(
                f"a 2-D mesh named {HSDP_DIMS} asks for hybrid sharding (HSDP: shard inside each group, "
                "replicate across groups), which fused_zero does not do yet; shard over all of its ranks "
                "instead (process_group=None for the default group, or mesh=mesh._flatten())")
        raise ValueError(
            f"mesh has {mesh.ndim} dimensions {names or '(unnamed)'}: pass the data-parallel sub-mesh the optimizer "
            "shards over, a 1-D mesh such as mesh[\"dp\"] of a (\"tp\", \"dp\") mesh")

    def check_device(self, device) -> None:
        """The mesh's device type is the parameters' (a CUDA mesh over CPU parameters cannot carry them)."""
        if self.mesh is not None and self.mesh.device_type != device.type:
            raise ValueError(f"mesh is a {self.mesh.device_type!r} mesh but the parameters are on {device.type}: "
                             f"build the mesh with init_device_mesh({device.type!r}, ...), or move the model")

    def describe(self) -> tuple:
        """What every rank of the group must agree on (the mesh's shape and dimension names)."""
        if self.mesh is None:
            return ()
        return (self.mesh.device_type, tuple(self.mesh.shape), tuple(self.mesh.mesh_dim_names or ()))

    def own_group(self, backend: str | None = None) -> Comm:
        """A new group over the shard group's ranks, for work of its own (every rank must call it)."""
        return self.shard.duplicate(backend)
