"""The model and a ShardedOptimizer as a checkpoint sees them: names, shapes, groups, shard kinds."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..sharding.units import is_compiled

BASE_KINDS = ("master", "exp_avg", "exp_avg_sq")  # every shard holds these
# the option that gives a shard each further kind
OPTION_OF_KIND = {"max_exp_avg_sq": "amsgrad=True"}


def group_hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters: everything but its parameters."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


class ModelView:
    """Names, shapes and places of the parameters and buffers of (model, ShardedOptimizer)."""

    def __init__(self, model: nn.Module, opt) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be the torch.nn.Module being trained, got {type(model).__name__}")
        # torch.compile(model), or torch.compile(block) registered in the model (torchtitan): its parameters are the
        # original module's, named under "_orig_mod."; the checkpoint keeps the model's own names, so it loads into
        # the model compiled or not (and into torch), as torch.distributed.checkpoint's names do
        model = _uncompiled(model)
        self.names: dict[int, list[str]] = {}  # id(param) -> its state-dict keys; the first is its name
        self.params: dict[int, nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # persistent buffers by state-dict key
        self.keys: list[str] = []  # model.state_dict()'s keys, in its order
        for prefix, mod in model.named_modules(remove_duplicate=False):
            if type(mod).get_extra_state is not nn.Module.get_extra_state:
                raise TypeError(f"module {prefix or type(mod).__name__!r} defines get_extra_state(), which "
                                "fused_zero.checkpoint does not save: pass that state as extra=")
            prefix = plain_name(prefix)
            pre = prefix + "." if prefix else ""
            for n, p in mod._parameters.items():
                if p is not None:
                    self.keys.append(pre + n)
                    self.names.setdefault(id(p), []).append(pre + n)
                    self.params[id(p)] = p
            for n, b in mod._buffers.items():
                if b is not None and n not in mod._non_persistent_buffers_set:
                    self.keys.append(pre + n)
                    self.buffers[pre + n] = b
        self.opt = opt
        self.index = opt.shard_index()
        self.where = {id(p): (k, i) for k, part in enumerate(self.index) for i, p in enumerate(part.params)}
        # Stage 3 releases parameters outside forward (0-element placeholders): take their
        # shapes from the partitions, never from the tensors.
        self.shapes = {k: list(part.shapes) for k, part in enumerate(self.index)}
        # stage 3's frozen parameters: sharded weights in no shard_index() entry (saved whole, from frozen_weights())
        self.frozen = {id(p): tuple(s) for part in opt.frozen_index() for p, s in zip(part.params, part.shapes)}
        self.groups: list[list[str]] = []  # names per param group, in group order
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) not in self.names:
                    if self._gone_frozen(p):
                        continue  # frozen when laid out, no longer the model's (peft's delete_adapter): nothing saved
                    raise ValueError(f"param group {gi} holds {self._label(p, opt)} that is not in "
                                     "model.named_parameters(): fused_zero.checkpoint names every trained parameter "
                                     "by its place in the model. Pass the model this optimizer trains; a parameter "
                                     "kept outside it (a learnable loss temperature) needs registering on it "
                                     "(model.temperature = nn.Parameter(...), before building the optimizer), or "
                                     "save optimizer.state_dict() and the model's weights instead")
            self.groups.append([self.names[id(p)][0] for p in group["params"] if id(p) in self.names])
        self.group_of = {n: gi for gi, names in enumerate(self.groups) for n in names}

    def _gone_frozen(self, p) -> bool:
        """``p`` (in a param group, not in the model) holds nothing here: stages 1-2 left it out of every partition,
        frozen when laid out (stage 3 shards frozen parameters: those are the model's, or refused before this)."""
        return id(p) not in self.where and id(p) not in self.frozen and not p.requires_grad and p.grad is None

    def _label(self, p, opt) -> str:
        """``p`` in a message: the name the optimizer knows it by, else its shape (the partition's, not a stage-3
        placeholder's)."""
        name = getattr(opt, "_names", {}).get(p)
        if name is not None:
            return f"parameter {name!r}"
        k, i = self.where.get(id(p), (None, None))
        shape = tuple(self.shapes[k][i]) if k is not None else self.frozen.get(id(p), tuple(p.shape))
        return f"a parameter of shape {shape}"

    def kinds(self, p) -> tuple[str, ...]:
        """The state kinds the shard of trained parameter ``p`` holds."""
        return self.index[self.where[id(p)][0]].kinds

    def name(self, p) -> str:
        return self.names[id(p)][0]

    def shape(self, p) -> tuple[int, ...]:
        if id(p) not in self.where:
            return self.frozen.get(id(p), tuple(p.shape))
        k, i = self.where[id(p)]
        return tuple(self.shapes[k][i])

    def expected(self) -> dict[str, tuple]:
        """state-dict key -> shape, for every parameter (aliases too) and persistent buffer."""
        out = {n: self.shape(p) for pid, p in self.params.items() for n in self.names[pid]}
        out.update({k: tuple(b.shape) for k, b in self.buffers.items()})
        return {k: out[k] for k in self.keys}

    def unmanaged(self) -> dict[str, nn.Parameter]:
        """Model parameters the optimizer does not hold, by name."""
        return {self.name(p): p for pid, p in self.params.items() if pid not in self.where}


def plain_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` of the ``torch.compile`` wrappers on its path."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (an ``OptimizedModule``'s ``_orig_mod``), else ``model``."""
    while is_compiled(model):
        model = model._orig_mod
    return model
