"""A partition: the parameters of one (param group, dtype) and the memory they live in.

Its parameters are views into one padded flat buffer laid out by
``layout.build_layout``; this rank keeps the reduced gradient and, through a
``ShardStore``, the fp32 master weights and Adam moments only for its shard of
every bucket, concatenated into flat shard buffers.

The partition owns that memory's whole life: it binds the parameters as views
(``bind``), can release the full buffer to zero bytes with the parameters on
an empty placeholder (``release``, stage 3) and materialize it again
(``materialize``), and takes in what user code did to the parameters behind
its back (``adopt_outside_changes``: ``model.to()`` that copied, ``p.data = t``,
``model.load_state_dict``; ``adopt_assigned`` for released stage-3 parameters).
"""
from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from .layout import Bucket, FlatLayout, ShardPiece
from ..tiers.factory import ON_DEVICE, Tiers
from ..tiers.param_store import OwnSlices
from ..tiers.tier import Tier
from ..tiers.transfer import host_buffer
from ..user_frames import user_stacklevel


class Placeholders:
    """The empty tensor a released parameter points at: one per (dtype, device), shared by every parameter
    (stage 3 between gathers, stages 1-2 while their update runs behind step()). Called with the parameter."""

    def __init__(self) -> None:
        self._made: dict = {}

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.dtype, p.device)
        if key not in self._made:
            self._made[key] = torch.empty(0, dtype=p.dtype, device=p.device)
        return self._made[key]


def unalias(partitions) -> list[list[int]]:
    """``Partition.unalias`` on each of ``partitions`` against all their flat buffers: before any of them takes in
    what user code assigned to its parameters. Each one's changed parameters (for ``adopt_outside_changes``)."""
    flats = {key for key in (part.flat.untyped_storage().data_ptr() for part in partitions) if key}  # (0: released)
    return [part.unalias(flats) for part in partitions]


class PartitionIndex(NamedTuple):
    """What a partition's shard holds, for code outside the optimizer (checkpoints)."""

    group_index: int
    params: tuple  # the partition's parameters, in layout order
    shapes: tuple  # their shapes (stage 3 parameters may be 0-element placeholders)
    pieces: tuple[ShardPiece, ...]  # runs of parameter elements in this rank's shard
    shard_numel: int
    kinds: tuple[str, ...]  # the state kinds the shard holds (store.STATE_KINDS, + max_exp_avg_sq)


class Partition:
    """The flat buffers of the parameters of one (param group, dtype)."""

    def __init__(self, group_index: int, params: list[torch.nn.Parameter], layout: FlatLayout, rank: int,
                 reduce_dtype: torch.dtype, amsgrad: bool = False, tiers: Tiers = ON_DEVICE,
                 frozen: bool = False) -> None:
        """``tiers``: where the states and the narrow param shard live (``tiers/factory.py`` decides);
        ``frozen``: weights only (frozen.py, stage 3), never reduced or updated."""
        self.group_index = group_index
        self.params = params
        # Kept: stage 3 points released parameters at empty tensors.
        self.shapes = tuple(p.shape for p in params)
        self.layout = layout
        self.rank = rank
        # The layout is frozen: its per-step lookups are computed once here.
        self.pieces = layout.shard_pieces(rank)
        self.bucket_params = tuple(layout.params_of_bucket(k) for k in range(len(layout.buckets)))
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.reduce_dtype = reduce_dtype
        self.flat = torch.zeros(layout.numel, dtype=self.dtype, device=self.device)
        n = layout.shard_numel
        # The narrow param shard: written back by the fused kernel, then all-gathered (tiers/factory.py).
        self.store, self.pshard, self.grad_tier = tiers(n, self.device, self.dtype, amsgrad,
                                                        lambda: OwnSlices(self.flat, layout, rank), frozen)
        # The reduced gradient shard lives where the update runs: beside the states, on the host when they
        # are offloaded (GradSync copies each bucket's shard down as soon as it is reduced).
        self.frozen = frozen
        self.grad_shard = (None if frozen else torch.zeros(n, dtype=reduce_dtype, device=self.device)
                           if self.grad_tier is Tier.DEVICE
                           else host_buffer(n, reduce_dtype, pinned=self.device.type == "cuda"))
        self.step_counts = None  # the parameters' step counts (update.py's StepCounts), from the first update
        self.state_edited = [False]  # user code wrote into optimizer.state[p] of one of these (state_views.ParamState)
        # load_state_dict's saved masters the parameters did not round to yet ({(param index, offset): fp32}): the
        # model's weights loaded after the optimizer's state take them in (_reload_master); dropped at the step
        self.pending_master: dict | None = None
        self._versions: list[int] = []
        self._ptrs: list[int] = []
        self._pshard_lost = False  # a write of the narrow param shard failed: rewritten before its next use
        self._substituted = False  # the gather serves stage_substitute's values (a read failed among ranks)
        self._unfit: list[int] = []  # parameters adopt_outside_changes refused (p.data of another shape or dtype)
        self._released_versions: list[int] | None = None  # stage 3: version counters at release
        self._lent: dict[int, tuple[int, int]] = {}  # stage 3: memory lent to a load (lend_for_load): address, version
        self.lossy_gather = False  # stage 3: its last gather sent quantized values (param_comm, ParamSync.lossy)
        self._pieces_of: dict | None = None  # param index -> its pieces (state_views)
        self._views: list[torch.Tensor] | None = None  # the parameters' views of flat (views())
        self.bind()

    # -- the parameters as views of the flat buffer ---------------------------
    def views(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, the view of the flat buffer it should be), in layout order.

        Made once: a view shares the flat buffer's storage, so it stays valid across stage 3's
        ``release``/``materialize`` (the storage resized to 0 bytes and back), as autograd's saved views do."""
        if self._views is None:
            self._views = [self.flat[slot.offset: slot.offset + slot.numel].view(shape)
                           for slot, shape in zip(self.layout.slots, self.shapes)]
        return zip(self.params, self._views)

    @torch.no_grad()
    def bind(self) -> None:
        """flat <- the parameters' values; the parameters become views of it; master <- flat."""
        for p, view in self.views():
            view.copy_(p)
            p.data = view
        self.load_master_from_params()
        self.mark_synced()

    def point_params(self) -> None:
        """The parameters view the (materialized) flat buffer again."""
        for p, view in self.views():
            p.data = view

    def pieces_of(self, index: int) -> list:
        """This rank's pieces of parameter ``index``, in parameter order (shard order too)."""
        if self._pieces_of is None:
            self._pieces_of = {}
            for pc in self.pieces:
                self._pieces_of.setdefault(pc.param_index, []).append(pc)
        return sorted(self._pieces_of.get(index, []), key=lambda pc: pc.param_offset)

    def release(self, placeholder: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Free the flat buffer's memory; the parameters point at ``placeholder(p)``."""
        for p in self.params:
            p.data = placeholder(p)
        self._released_versions = [p._version for p in self.params]
        self.flat.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Give the flat buffer its memory back (values undefined until gathered)."""
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())

    def mark_synced(self) -> None:
        """Remember where the parameters live and their version counters (an in-place write bumps them)."""
        self._versions = [p._version for p in self.params]
        self._ptrs = [p.data_ptr() for p in self.params]
        for i in self._unfit:  # refused (adopt_outside_changes): compared, and refused, again at the next step
            self._ptrs[i] = -1

    def mark_written(self, flags: tuple[bool, ...]) -> None:
        """Bump the autograd version of the parameters ``flags`` marks (those the step updates): the update writes
        the flat buffers they view (stage 3: the shards their next gather reads), which autograd does not see. The
        versions remembered for finding user code's writes (``mark_synced``, ``release``) move with them, so a
        write user code made before still shows. One C call."""
        if all(flags):  # (the common case: one C call, and one pass over each remembered list)
            torch.autograd.graph.increment_version(self.params)
            if len(self._versions) == len(self.params):
                self._versions = [v + 1 for v in self._versions]
            if self._released_versions is not None and len(self._released_versions) == len(self.params):
                self._released_versions = [v + 1 for v in self._released_versions]
            return
        written = [i for i, f in enumerate(flags) if f]
        if not written:
            return
        torch.autograd.graph.increment_version([self.params[i] for i in written])
        for versions in (self._versions, self._released_versions):
            if versions is not None and len(versions) == len(self.params):
                for i in written:
                    versions[i] += 1

    def shift_versions(self, index: int, n: int) -> None:
        """Move the remembered versions of parameter ``index`` by ``n``: bumps the optimizer made through another
        parameter sharing its version counter (``update.mark_written``)."""
        for versions in (self._versions, self._released_versions):
            if n and versions is not None and len(versions) == len(self.params):
                versions[index] += n

    def check_fit(self, names: dict) -> None:
        """Raise what ``adopt_outside_changes`` would refuse, changing nothing (clip_grad_norm_: the step that
        follows makes no all-reduce of its own, so a refusal must be known at the clip's)."""
        for i in self._changed():
            self._check_compatible(self.params[i], self.shapes[i], names)

    @torch.no_grad()
    def unalias(self, flats: set[int]) -> list[int]:
        """Parameters user code pointed at memory of a flat buffer other than their own slot (``flats``: the
        storages of every partition taking changes in: ``a.data, b.data = b.data, a.data``, ``b.data = a.data``)
        get a copy of the values they were given. Taking the changes in copies each parameter into its own slot,
        one after another: without it a later one would read what an earlier copy wrote. Call on every
        partition before any takes its changes in. Returns the changed parameters (``_changed``)."""
        changed = self._changed()
        base, size = self.flat.data_ptr(), self.flat.element_size()
        for i in changed:
            p = self.params[i]
            if p.numel() and p.untyped_storage().data_ptr() in flats and \
                    p.data_ptr() != base + self.layout.slots[i].offset * size:  # (written in place: left alone)
                p.data = p.data.clone()
        return changed

    def _changed(self) -> list[int]:
        """The parameters user code moved or wrote in place since ``mark_synced`` (two reads a parameter: the
        common case, nothing changed)."""
        ptrs, versions = self._ptrs, self._versions
        return [i for i, p in enumerate(self.params) if p.data_ptr() != ptrs[i] or p._version != versions[i]]

    @torch.no_grad()
    def adopt_outside_changes(self, names: dict, changed: list[int] | None = None) -> None:
        """Take in what user code did to the (bound) parameters since the optimizer last wrote them.

        A parameter that no longer views the flat buffer (``model.to()`` that copied,
        ``p.data = t``) is copied back in and bound
        again; one written in place (``model.load_state_dict``, ``p.copy_``) keeps its
        new values. Either way its master is reloaded, as torch.optim would step from
        the values the parameter holds. A parameter whose shape, dtype or device
        changed cannot live in this buffer: a RuntimeError names the call. ``changed``: ``_changed()``, when
        the caller just found it (``unalias``).
        """
        changed = self._changed() if changed is None else changed
        refused, unfit = None, []
        for i in changed:  # all checked before any is taken in: one that cannot be is left as it is
            try:
                self._check_compatible(self.params[i], self.shapes[i], names)
            except RuntimeError as error:  # (the step is refused; maybe on this rank alone)
                refused = refused or error
                unfit.append(i)
        taken = [i for i in changed if i not in unfit]
        for i in taken:
            slot = self.layout.slots[i]
            self._bind_back(self.params[i], self.flat[slot.offset: slot.offset + slot.numel].view(self.shapes[i]),
                            names)
        if taken:
            self._reload_master(taken, lambda i: self.params[i].detach().reshape(-1))
        self._unfit = unfit
        self.mark_synced()
        if refused is not None:
            raise refused

    @torch.no_grad()
    def take_in_written(self, names: dict) -> None:
        """Stage 3, gathered, about to be released: parameters written in place since the gather (an
        ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up inside its forward; a ``clamp_`` of a
        weight in forward) have this rank's shard of the new values taken into the master, as stages 1-2 take
        such writes in at step() (``adopt_outside_changes``): the update steps from them, and the next gather
        (this backward's, the next forward's) holds them. Where ranks wrote different values, each rank's shard
        comes from its own, as at stages 1-2. One bulk comparison of the version counters when nothing changed."""
        if [p._version for p in self.params] != self._versions:
            if self.lossy_gather:  # its gathered values are qwZ's approximations: taken in, they would round the
                _warn_lossy_write()  # master through int8 (whatever the write changed)
                self.mark_synced()
                return
            self.adopt_outside_changes(names)

    @torch.no_grad()
    def lend_for_load(self, index: int) -> None:
        """Stage 3, released: parameter ``index`` gets full-size memory for ``model.load_state_dict`` to copy into,
        filled with a NaN of a payload no computation makes (``_UNWRITTEN``). ``adopt_assigned`` takes in only the
        elements a load wrote, however it wrote them (``param.copy_``, ``p.data.copy_``, a slice of it: a checkpoint
        of a smaller vocabulary); where it wrote nothing (its key failed to load: another shape, not a tensor; the
        load raised before reaching it) the parameter keeps its values, as torch's."""
        p = self.params[index]
        loan = torch.empty(self.shapes[index], dtype=p.dtype, device=p.device)
        bits = _UNWRITTEN.get(p.dtype)
        if bits is not None:
            loan.view(bits[0]).fill_(bits[1])
        p.data = loan
        self._lent[index] = (loan.data_ptr(), p._version)

    def _written(self, lent: dict, index: int, p: torch.Tensor) -> torch.Tensor | bool:
        """For a parameter ``adopt_assigned`` finds full: True where it is all to take in (assigned, or lent memory
        of a dtype without an unwritten mark), a mask of the elements a load wrote into lent memory, False where
        it wrote none."""
        loan = lent.get(index)
        if loan is None or loan[0] != p.data_ptr():
            return True
        bits = _UNWRITTEN.get(p.dtype)
        if bits is None:  # (integer weights: written through the parameter, by torch's own load, or not at all)
            return p._version != loan[1]
        mask = p.detach().view(bits[0]).reshape(-1) != bits[1]
        return mask if bool(mask.any()) else False

    @torch.no_grad()
    def adopt_assigned(self, names: dict, placeholder: Callable[[torch.Tensor], torch.Tensor],
                       skip: frozenset = frozenset()) -> bool:
        """Stage 3, released: take in full values user code assigned to the placeholders.

        Parameters that hold a full tensor (``p.data = t``, a load into a materialized
        parameter) have this rank's shard of it written into the master; they go back
        to the placeholder. Parameters in ``skip`` are only put back. Returns whether
        anything was taken in.
        """
        changed, values, masks = [], {}, {}
        versions, lent = self._released_versions, self._lent
        if not lent and versions is not None and self._untouched(versions):
            return False
        if lent:
            self._lent = {}
        for i, p in enumerate(self.params):
            if p.numel() == 0:  # the placeholder, or a zero-element parameter
                self.check_kind(p, self.shapes[i], names)
                if versions is not None and p._version != versions[i] and self.shapes[i].numel() > 0:
                    versions[i] = p._version  # refused once; the write itself is lost either way
                    shown = names.get(p, f"of shape {tuple(self.shapes[i])}")
                    raise RuntimeError(
                        f"parameter {shown} was written in place between steps "
                        "(nn.init.*_, p.fill_(), p.copy_(), p.mul_(), a parametrization or pruning registered on "
                        "it, ...) while ZeRO stage 3 held only its shard: the write went to an empty placeholder "
                        "and changed nothing. Make such changes inside "
                        "`with optimizer.full_parameters(writeback=True):` (every rank enters it), or assign a "
                        "full tensor (p.data = t)")
                continue
            written = False if i in skip else self._written(lent, i, p) if lent else True
            if written is not False:
                self._check_compatible(p, self.shapes[i], names)
                changed.append(i)
                values[i] = p.detach().reshape(-1)
                if written is not True:
                    masks[i] = written
            p.data = placeholder(p)
        self._released_versions = [p._version for p in self.params]
        if changed:
            self._reload_master(changed, values.__getitem__, masks)
        return bool(changed)

    def put_back(self, placeholder: torch.Tensor) -> None:
        """Stage 3, released: every parameter on ``placeholder`` again, what user code assigned dropped (refused)."""
        for p in self.params:
            p.data = placeholder
        self._lent = {}
        self._released_versions = [p._version for p in self.params]

    def _untouched(self, versions: list[int]) -> bool:
        """Every parameter still holds what ``release`` gave it, of the partition's dtype and device, and none
        was written in place: ``adopt_assigned``'s common case, checked in bulk (a full tensor assigned has
        memory of its own, so a nonzero address; an empty one the placeholder's none)."""
        params, dtype, device = self.params, self.dtype, self.device
        return (not any([p.data_ptr() for p in params]) and [p._version for p in params] == versions
                and all([p.dtype is dtype for p in params]) and all([p.device == device for p in params]))

    def _check_compatible(self, p: torch.Tensor, shape: torch.Size, names: dict) -> None:
        if tuple(p.shape) != tuple(shape):
            self._refuse(p, shape, names, "shape", tuple(shape), tuple(p.shape), "a resize or p.data = t")
        self.check_kind(p, shape, names)

    @torch.no_grad()
    def take_in_assigned_full(self, names: dict) -> None:
        """Gathered (or always full: stages 1-2): parameters user code assigned a full tensor (``p.data = t``, as
        peft's safe merge writes) have it copied into the flat buffer, and view the buffer again. For a writeback
        that reads the buffer (``full_parameters(writeback=True)``), which would otherwise miss them."""
        for p, view in self.views():
            self._bind_back(p, view, names)

    def _bind_back(self, p: torch.Tensor, view: torch.Tensor, names: dict) -> None:
        """``p`` views ``view`` again: a tensor assigned to it (``p.data = t``, a ``model.to()`` that copied) is
        copied in first, once its shape, dtype and device are checked (else the clear refusal)."""
        if p.data_ptr() != view.data_ptr() or p.shape != view.shape or p.dtype != view.dtype \
                or p.device != view.device:
            self._check_compatible(p, view.shape, names)
            view.copy_(p)
            p.data = view

    def check_kind(self, p: torch.Tensor, shape: torch.Size, names: dict) -> None:
        """``p`` still has the dtype and device the optimizer was built with (else the clear refusal)."""
        if p.dtype != self.dtype:
            self._refuse(p, shape, names, "dtype", self.dtype, p.dtype,
                         "model.to(dtype), .double(), .half() or .bfloat16()")
        if p.device != self.device:
            self._refuse(p, shape, names, "device", self.device, p.device, "model.to(device), .cuda() or .cpu()")

    @staticmethod
    def _refuse(p, shape, names, what, then, now, call) -> None:
        shown = names.get(p, f"of shape {tuple(shape)}")
        raise RuntimeError(
            f"parameter {shown} changed {what} from {then} to {now} after the "
            f"optimizer was built ({call}): the optimizer's flat buffers and fp32 masters keep the old "
            f"one. Convert or move the model before building ShardedOptimizer, or build a new one after")

    def _reload_master(self, indices: list[int], values: Callable[[int], torch.Tensor],
                       written: dict | None = None) -> None:
        """The master (and narrow param shard) of the parameters ``indices`` <- their given values; where a
        master ``load_state_dict`` kept aside rounds to them (the model's weights loaded after the optimizer's
        state), that master; else, for narrow parameters whose master rounds to every one of the values already
        (the same weights loaded again, as torch.distributed.checkpoint's loads do), the master they have. Values
        that differ anywhere in this rank's piece (weights of another step restored) reload it whole. ``written``:
        per parameter, a mask of the elements to take (a load that wrote part of lent memory); the others keep
        their master."""
        wanted = set(indices)
        pending = self.pending_master
        keep = self.keeps_master
        for piece in self.pieces:
            if piece.param_index in wanted:
                v = values(piece.param_index)[piece.param_offset: piece.param_offset + piece.numel]
                v32 = v.to(device=self.device, dtype=torch.float32)
                old = None
                if keep and piece.numel:
                    old = self._values_now(piece)  # (the master: keep says the store holds one)
                    if torch.equal(old.to(v.dtype), v.to(self.device)):
                        v32 = old
                saved = None if pending is None else pending.pop((piece.param_index, piece.param_offset), None)
                if saved is not None:
                    saved = saved.to(self.device)
                    v32 = torch.where(saved.to(v.dtype) == v.to(self.device), saved, v32)
                mask = None if written is None else written.get(piece.param_index)
                if mask is not None and piece.numel:
                    mask = mask[piece.param_offset: piece.param_offset + piece.numel].to(self.device)
                    old = self._values_now(piece) if old is None else old
                    v32 = torch.where(mask, v32.to(self.device), old)
                    v = torch.where(mask, v.to(self.device), old.to(v.dtype))
                self.store.write("master", piece.shard_offset, v32)
                if self.pshard is not None and not self.pshard.is_params:  # own slices hold v already
                    self.pshard.write(piece.shard_offset, v)

    def _values_now(self, piece) -> torch.Tensor:
        """This rank's values of ``piece`` as fp32 on the device: its master, or a frozen partition's weights
        (kept in the param shard only)."""
        a, b = piece.shard_offset, piece.shard_offset + piece.numel
        if "master" in self.store.kinds:
            return self.store.read("master", a, b).to(self.device)
        self.pshard.fetch()
        try:
            return self.pshard.source(a, b).to(device=self.device, dtype=torch.float32, copy=True)
        finally:
            self.pshard.drop()

    # -- shards ------------------------------------------------------------
    @torch.no_grad()
    def load_master_from_params(self, changed_only: bool = False) -> None:
        """master (and the narrow param shard) <- this rank's shard of the flat buffer.

        Whenever the parameters were changed outside the optimizer: step() would
        otherwise overwrite them from the old master. ``changed_only`` (a writeback of
        parameters narrower than fp32): only the elements whose value no longer is their
        master's rounding take the new value; the others keep their fp32 master (reloaded
        whole, every master would lose what bf16 cannot hold: half a bf16 step a writeback).
        """
        keep = changed_only and self.keeps_master
        for b in self.layout.buckets:
            new = self.bucket(self.flat, b)[self.own(b)]
            if keep and new.numel():
                old = self.store.read("master", b.shard_offset, b.shard_offset + new.numel()).to(new.device)
                new = torch.where(new == old.to(self.dtype), old, new.float())
            self.store.write("master", b.shard_offset, new)
        if self.pshard is not None and not self.pshard.is_params:
            for b in self.layout.buckets:
                self.pshard.write(b.shard_offset, self.bucket(self.flat, b)[self.own(b)])

    @torch.no_grad()
    def param_shard_from_master(self) -> None:
        """The narrow param shard <- the master (rounded): after the master was written directly.

        With own slices that is the parameters themselves (a rolled-back step puts them back)."""
        if self.pshard is not None:
            self.pshard.write(0, self.store.read("master", 0, self.layout.shard_numel).to(self.dtype))
            if self.pshard.is_params:
                self.mark_synced()

    def restore_param_shard(self) -> None:
        """After a failed step (``update.rollback``): the narrow param shard <- the master as it was before it. If
        the disk fails this too, the shard is rewritten before its next use (the gather raises if it still
        cannot), never gathered half-updated; where the shard is the parameters themselves (stages 1-2), which
        the next forward reads as they are, an OSError says they hold part of the step."""
        try:
            self.param_shard_from_master()
        except OSError as e:
            self._pshard_lost = True
            if self.pshard.is_params:  # stages 1-2: the update wrote the parameters themselves, now unrestorable
                raise OSError(e.errno, f"{e.strerror}: after a failed step the parameters could not be put back "
                              "(reading the optimizer states failed too), so they hold part of that step: reload a "
                              "checkpoint before training on") from e

    def param_shard_lost(self, error: OSError) -> None:
        """A write of the NVMe param shard failed in a step whose states are in memory (``update.run_job``): the
        step is done (a store in memory cannot undo it) and the shard is rewritten from the master before its
        next gather, so nothing trains on a half-written shard."""
        self._pshard_lost = True
        warnings.warn(f"{error}; the step is done (its optimizer states are in memory, where a step is not undone) "
                      "and the parameter shard is rewritten from the fp32 master before its next gather (which "
                      "raises if the disk still fails)", RuntimeWarning, stacklevel=user_stacklevel())

    def _param_shard_whole(self) -> None:
        if self._pshard_lost:
            self.param_shard_from_master()
            self._pshard_lost = False

    def update_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` cut where the narrow param shard needs it (``ParamShard.edges``: bucket edges for own
        slices, every chunk for a staged tier), on multiples of ALIGN (config.ALIGN's chunk-edge rule)."""
        edges = self.store.edges() if self.pshard is None else self.pshard.edges()
        if not edges:
            return ranges
        out = []
        for a, z in ranges:
            i = bisect.bisect_right(edges, a)
            while i < len(edges) and edges[i] < z:
                out.append((a, edges[i]))
                a, i = edges[i], i + 1
            out.append((a, z))
        return out

    def param_sink(self):
        """What the update writes the narrow params into (``[a:b]``), or None (fp32 gathered from the master)."""
        return None if self.pshard is None else self.pshard.sink()

    def fetch_params(self) -> None:
        """Stage 3: start bringing the param shard to the device for the next gather (a prefetch)."""
        if self.pshard is not None:
            self._param_shard_whole()
            self.pshard.fetch()

    def stage_params(self) -> None:
        """Stage 3: wait for the offloaded param shard's read (prefetched, or started now) before its gather: an
        ``OSError`` naming the file if it failed (``gather_source`` then serves the staged copy)."""
        if self.pshard is not None:
            self._param_shard_whole()
            self.pshard.source(0, 0)

    @property
    def keeps_master(self) -> bool:
        """Whether the store keeps an fp32 master apart from the parameters (bf16/fp16 ones), which says more than
        they do: ``state_dict()`` saves it and a reload keeps what still rounds to them."""
        return self.dtype != torch.float32 and "master" in self.store.kinds

    def stage_substitute(self) -> None:
        """Stage 3, among ranks, after ``stage_params`` failed: the gather serves the fp32 master rounded to the
        parameters' dtype (what the shard holds after an update), or NaN where the master cannot be read either
        (frozen weights keep none), so that every rank's output shows it rather than a plausible wrong value (zeros
        for an integer dtype); the step that follows is refused on every rank (``ParamGatherer._read_shard``)."""
        n = self.layout.shard_numel
        try:
            values = self.store.read("master", 0, n).to(self.dtype)
        except (OSError, ValueError):  # its file fails too, or no master is kept
            values = torch.full((n,), float("nan"), dtype=self.dtype) if self.dtype.is_floating_point else \
                torch.zeros(n, dtype=self.dtype)
        self.pshard.stage(values)
        self._substituted = True

    @property
    def reads_params(self) -> bool:
        """Whether a gather reads the param shard from a file (``offload_params="nvme"``), which may fail."""
        return self.pshard is not None and self.pshard.tier is Tier.NVME

    def drop_fetched(self) -> None:
        """Stage 3: the gather is done (or stale): drop the shard's staged copy."""
        if self.pshard is not None:
            self.pshard.drop()
            self._substituted = False

    def bucket(self, full: torch.Tensor, b: Bucket) -> torch.Tensor:
        """The view of a full-size flat buffer that bucket ``b`` covers."""
        return full[b.offset: b.offset + b.numel]

    def shard(self, shard_buffer: torch.Tensor, b: Bucket) -> torch.Tensor:
        """The view of a shard buffer that holds this rank's part of ``b``."""
        return shard_buffer[b.shard_offset: b.shard_offset + b.shard_numel]

    def gather_source(self, b: Bucket) -> torch.Tensor:
        """What this rank contributes to bucket ``b``'s all-gather of params."""
        if self.pshard is None:
            return self.store.gather_source(b.shard_offset, b.shard_offset + b.shard_numel)
        if not self._substituted:  # (a substitute stands for a shard that could not be rewritten or read)
            self._param_shard_whole()
        return self.pshard.source(b.shard_offset, b.shard_offset + b.shard_numel)

    def own(self, b: Bucket) -> slice:
        """This rank's slice of bucket ``b``, relative to the bucket (``layout.shard_range``)."""
        start, end = self.layout.shard_range(b, self.rank)
        return slice(start - b.offset, end - b.offset)

    def index(self) -> PartitionIndex:
        return PartitionIndex(self.group_index, tuple(self.params), self.shapes, self.pieces,
                              self.layout.shard_numel, self.store.kinds)

    def shard_bytes(self) -> dict[str, int]:
        def nbytes(t):
            return 0 if t is None else t.untyped_storage().nbytes()

        shard = 0 if self.pshard is None else self.pshard.nbytes()
        return {"params": nbytes(self.flat), "grad_shard": nbytes(self.grad_shard),
                "param_shard": shard if self.param_tier is Tier.DEVICE else 0,
                "param_shard_offloaded": 0 if self.param_tier is Tier.DEVICE else shard, **self.store.nbytes()}

    @property
    def param_tier(self) -> Tier:
        """Where the narrow param shard lives."""
        return Tier.DEVICE if self.pshard is None else self.pshard.tier

    def close(self) -> None:
        """Give back the files the states and the param shard hold."""
        self.store.close()
        if self.pshard is not None:
            self.pshard.close()


_LOSSY_WARNED = False


def read_params_first(parts, comm) -> None:
    """Stage 3, before a gather that serves what user code keeps (``full_parameters()``, a checkpoint's frozen
    weights, ``close()``): read the param shards of ``parts`` that live in a file, so that a failed read raises (an
    OSError naming the file) before any gather, and among the ranks of ``comm`` on every one of them (``rank r
    failed: ...`` on the others), never a substitute (``ParamGatherer._read_shard``, a training gather's)."""
    parts = [part for part in parts if part.reads_params]
    if not parts:
        return
    if comm.world_size > 1:
        comm.agree(lambda: [part.stage_params() for part in parts])
    else:
        for part in parts:
            part.stage_params()


def _warn_lossy_write() -> None:
    global _LOSSY_WARNED
    if not _LOSSY_WARNED:
        _LOSSY_WARNED = True
        warnings.warn("a parameter was written in place inside the forward (nn.Embedding(max_norm=...) renormalising "
                      "rows, a clamp_ in forward) while its unit was gathered with param_comm=\"int8\": the gathered "
                      "values are approximations of the masters, so the write is not taken in (the master keeps its "
                      "value). Use param_comm=None to keep such writes", UserWarning, stacklevel=2)


#: What ``lend_for_load`` fills lent memory with, per dtype: (the integer view, its value), a quiet NaN with a
#: payload that no arithmetic makes (NaNs computed carry the default payload) and a load of real weights never holds
_UNWRITTEN = {torch.float32: (torch.int32, 0x7FC0_5AFE), torch.float64: (torch.int64, 0x7FF8_0000_5AFE_5AFE),
              torch.bfloat16: (torch.int16, 0x7FDB), torch.float16: (torch.int16, 0x7E5B)}
