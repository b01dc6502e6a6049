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
        released = [self.names.get(p, tuple(shape)) for u in self.units if not u.gathered
                    for part in u.parts for p, shape in zip(part.params, part.shapes)
                    if p.numel() == 0 and shape.numel() > 0]
        if released:
            raise RuntimeError(
                f"ZeRO stage 3 holds only a shard of {released[:3]}{' and more' if len(released) > 3 else ''}: "
                "model.state_dict() here would return 0-element tensors. Read it inside "
                "`with optimizer.full_parameters():` (every rank enters it), or save with fused_zero.checkpoint")
        # The gathered parameters view buffers whose memory goes back when their unit is released (leaving
        # full_parameters(), the end of a backward): a state dict holding those views would point at freed
        # memory (reading it crashed). Each parameter's entry is a copy (torch's are views), one per parameter
        # (tied names share it, as they share the parameter), as FSDP's full state dict clones; the
        # integrations that consume the dict inside full_parameters() skip it (``state_dict_views``).
        if self._views_ok:
            return
        copies: dict = {}
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            t = state_dict.get(name)
            if t is not None and id(p) in self._param_ids and t.numel():
                if id(p) not in copies:
                    copies[id(p)] = t.detach().clone().requires_grad_(t.requires_grad)
                state_dict[name] = copies[id(p)]

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
        self._load_prefix = prefix
        if self.behind is not None:
            self.behind.wait()  # the load writes the shards
        for u in self.units:
            if not u.gathered:
                self._wait(u)
                for part in u.parts:
                    for p, shape in zip(part.params, part.shapes):
                        if p.numel() == 0 and shape.numel() > 0:
                            p.data = torch.empty(shape, dtype=p.dtype, device=p.device)

    def _after_load(self, module, incompatible_keys) -> None:
        """Write each rank's shard of what was loaded into the masters; parameters go back to their shards."""
        missing = set(incompatible_keys.missing_keys)
        for u in self.units:
            for part in u.parts:
                if u.gathered:  # inside full_parameters(): the loaded values are kept
                    part.adopt_outside_changes(self.names)
                    continue
                skip = frozenset(i for i, p in enumerate(part.params)
                                 if self._load_prefix + self.names.get(p, "") in missing)
                part.adopt_assigned(self.names, self._placeholder, skip)
