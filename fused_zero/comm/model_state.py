"""Stage 3 and what user code does to the model between steps: ``p.data = t``, ``model.state_dict()`` and
``model.load_state_dict()``.

``adopt_assigned`` takes in full values assigned to released parameters. The gatherer's hooks on the root
module (registered in ``ParamGatherer.__init__``): a state dict read while units are released is refused
(it would hold 0-element tensors), and a load gives released parameters full-size memory to load into,
then writes each rank's shard of what was loaded into the masters.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..sharding.partition import unalias


class ModelStateHooks:
    """What ``ParamGatherer`` does about user code between steps (a mixin: it reads the gatherer's units,
    names, placeholders and waits)."""

    def adopt_assigned(self) -> None:
        """Take in full values user code assigned to released parameters (``p.data = t``)."""
        for u in self.units:
            if u.released:
                for part in u.parts:
                    part.adopt_assigned(self.names, self._placeholder)

    def _check_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        """The root's state-dict post-hook: the whole model's parameters."""
        self._in_root_state_dict = False
        self._state_dict_of(module, state_dict, prefix, None)

    def _root_state_dict_begins(self, module, prefix, keep_vars) -> None:
        self._in_root_state_dict, self._keep_vars = True, keep_vars

    def _sub_state_dict_begins(self, module, prefix, keep_vars) -> None:
        if not self._in_root_state_dict:
            self._keep_vars = keep_vars

    def _check_sub_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        """A submodule's (``model.head.state_dict()``, with or without a prefix: its own parameters); inside the
        root's state_dict() it leaves everything to the root's."""
        if not self._in_root_state_dict:
            self._state_dict_of(module, state_dict, prefix, {id(p) for p in module.parameters()})

    def _state_dict_of(self, module, state_dict, prefix, scope) -> None:
        released = [self.names.get(p, tuple(shape)) for u in self.units if not u.gathered
                    for part in u.parts for p, shape in zip(part.params, part.shapes)
                    if p.numel() == 0 and shape.numel() > 0 and (scope is None or id(p) in scope)]
        if released:
            raise RuntimeError(
                f"ZeRO stage 3 holds only a shard of {released[:3]}{' and more' if len(released) > 3 else ''}: "
                "state_dict() here would return 0-element tensors. Read it inside "
                "`with optimizer.full_parameters():` (every rank enters it; code that loads through it, as peft's "
                "set_peft_model_state_dict, inside `full_parameters(writeback=True)`; model.load_state_dict(sd) "
                "works anywhere), or save with fused_zero.checkpoint; "
                "with Accelerate, save_pretrained(..., state_dict=accelerator.get_state_dict(model)) (every rank "
                "calls it), as with DeepSpeed ZeRO-3")
        # The gathered parameters view buffers whose memory goes back when their unit is released (leaving
        # full_parameters(), the end of a backward): a state dict holding those views would point at freed
        # memory (reading it crashed). Each parameter's entry is a copy (torch's are views), one per parameter
        # (tied names share it, as they share the parameter), as FSDP's full state dict clones; the
        # integrations that consume the dict inside full_parameters() skip it (``state_dict_views``). Inside
        # ``full_parameters(writeback=True)`` a copy written in place (``dcp.load`` into the dict, ``sd[k].copy_``)
        # is taken into its parameter at the block's end, as a write through torch's view would be.
        if self._views_ok or self._keep_vars:  # state_dict(keep_vars=True): the Parameters themselves, as torch's
            return
        # The entries are found by the memory they view, not by name: a prefix without a dot, a hook that renames
        # keys (checkpoint_wrapper's strips "_checkpoint_wrapped_module."), one registered before the build, all
        # leave names that no parameter has, and a view left behind crashed when read after the block.
        params = {_where(p): p for p in module.parameters() if id(p) in self._param_ids and p.numel()}
        if not params:
            return
        storages = {key[0] for key in params}
        copies: dict = {}
        for name, t in list(state_dict.items()):
            if not isinstance(t, torch.Tensor) or not t.numel() or t.untyped_storage().data_ptr() not in storages:
                continue
            key = _where(t)
            if key not in copies:
                copies[key] = t.detach().clone().requires_grad_(t.requires_grad)
                p = params.get(key)
                if self._holding and p is not None:
                    self._sd_copies.append((copies[key], p, copies[key]._version))
            state_dict[name] = copies[key]

    def take_in_copies(self) -> None:
        """Inside ``full_parameters(writeback=True)``, at its end: the state-dict copies written in place since
        they were made go into their parameters (a load into the dict reaches the model, as torch's views)."""
        copies, self._sd_copies = self._sd_copies, []
        with torch.no_grad():
            for c, p, version in copies:
                if c._version != version and c.shape == p.shape:
                    p.copy_(c)

    @contextmanager
    def state_dict_views(self):
        """``model.state_dict()`` inside gives views of the gathered parameters, not copies: for a caller that is
        done with the dict before the units are released (a save inside ``full_parameters()``)."""
        self._views_ok, before = True, self._views_ok
        try:
            yield
        finally:
            self._views_ok = before

    def _before_load(self, module, state_dict, prefix, *args) -> None:
        """model.load_state_dict between steps: give released parameters full-size memory to load into."""
        self._load_scope = None
        self._prepare_load(None)

    def _before_sub_load(self, module, state_dict, prefix, *args) -> None:
        """A submodule's ``load_state_dict`` (``model.head.load_state_dict(sd)``): its own parameters (inside the
        root's, a prefix, the root's hooks serve)."""
        if not prefix:
            self._load_scope, self._load_module = {id(p) for p in module.parameters()}, module
            self._prepare_load(self._load_scope)

    def _prepare_load(self, scope) -> None:
        if self.behind is not None:
            self.behind.wait()  # the load writes the shards
        for u in self.units:
            if not u.gathered:
                self._wait(u)
                for part in u.parts:
                    for i, (p, shape) in enumerate(zip(part.params, part.shapes)):
                        if p.numel() == 0 and shape.numel() > 0 and (scope is None or id(p) in scope):
                            part.lend_for_load(i)  # what the load does not write is never taken in

    def _after_sub_load(self, module, incompatible_keys) -> None:
        if self._load_scope is not None and module is self._load_module:  # (its children's run first)
            scope, self._load_scope, self._load_module = self._load_scope, None, None
            self._finish_load(scope)

    def _after_load(self, module, incompatible_keys) -> None:
        """Write each rank's shard of what was loaded into the masters; parameters go back to their shards."""
        self._load_scope = None
        self._finish_load(None)

    def _finish_load(self, scope) -> None:
        unalias([part for u in self.units if u.gathered for part in u.parts])
        for u in self.units:
            for part in u.parts:
                if scope is not None and not any(id(p) in scope for p in part.params):
                    continue
                if u.gathered:  # inside full_parameters(): the loaded values are kept
                    part.adopt_outside_changes(self.names)
                    continue
                # (a key torch counts missing may still have been loaded by a module's own _load_from_state_dict:
                # lent memory tells what a load wrote)
                skip = frozenset(i for i, p in enumerate(part.params) if scope is not None and id(p) not in scope)
                part.adopt_assigned(self.names, self._placeholder, skip)


def _where(t: torch.Tensor) -> tuple:
    """The memory ``t`` views: a parameter and its state-dict entry (``p.detach()``) share it; tied names share one."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
