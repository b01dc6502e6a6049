"""ModelGuard: that the model still holds the parameters an optimizer given the model was built over.

Replacing a parameter by a new ``nn.Parameter`` (``model.to("meta")`` then ``to_empty()``, a module or parameter
assigned anew, a parametrization removed, ``resize_token_embeddings``) leaves the optimizer training the old
tensor while backward reaches the new one: torch.optim would do so silently; ``ShardedOptimizer`` refuses it at
its next check (each step; stage 3's gatherer before a forward). The check is cheap between registrations:
each param group's first and last parameter (a whole model, its head or its embedding) are looked up along
their paths, a dict lookup a hop; every trained parameter is looked for only after torch registered a
parameter, buffer or module somewhere in the model (``model_watch``'s flag).
"""
from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from . import model_watch


class ModelGuard:
    """The trained parameters of ``module`` by name, and where each param group's first and last one sits."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.watcher = model_watch.Watcher()  # set by torch's registration hooks on the model (model_watch)
        self._names: list = []  # (parameter, its name in the model) for every parameter the optimizer trains
        self._watched: list = []  # (dict holding it, key, object, name or None) along the watched paths

    def watch(self, param_groups) -> None:
        """Where the model holds each param group's first and last parameter: every hop of each one's path from
        the root (a modules dict, a key, the module there) and its parameters dict, once each, for ``check``."""
        self._watched = []
        names = {p: n for n, p in self.module.named_parameters()}  # (now: a parametrization may have moved one)
        # every parameter the optimizer trains, where the model holds it now: what a registration on the model
        # has every parameter checked against. A rebuild (add_param_group) after a registration that no check has
        # looked at yet keeps the names from before it: the next check looks at those too.
        trained = {id(q) for g in param_groups for q in g["params"]}
        kept = self._names if self.watcher.changed else []
        self._names = kept + [(p, n) for p, n in names.items() if id(p) in trained]
        model_watch.watch(self.module, self.watcher)
        hops = set()
        for g in param_groups:
            for p in {id(q): q for q in (g["params"][:1] + g["params"][-1:])}.values():
                name = names.get(p)
                if name is None:
                    continue  # no longer the model's (a replaced head with a new group added): trained by no one
                *path, leaf = name.split(".")
                m = self.module
                for key in path:
                    child = m._modules[key]
                    if (id(m), key) not in hops:
                        hops.add((id(m), key))
                        self._watched.append((m._modules, key, child, None))
                    m = child
                self._watched.append((m._parameters, leaf, p, name))

    def check(self, param_groups, trained: set, shards_params: bool) -> bool:
        """Refuse a model whose parameters were replaced by new nn.Parameter objects since ``watch``; then watch
        afresh. Only where a watched path moved, or after a registration, is the model searched: a parameter
        moved but still the model's (a parametrization registered: ``parametrizations.weight.original``) or a
        path now holding one of ``trained`` (a new head added by ``add_param_group``, at stages 1-2, not
        ``shards_params``) is watched where it is now. A trained parameter gone from the model is refused too (at
        stages 1-2 one frozen when laid out, which holds nothing here, may go, as under torch.optim).
        True: the model holds its parameters differently now (served), and was watched afresh."""
        flagged = self.watcher.changed
        if flagged:
            # torch registered a parameter or module on the model since the last look (a parametrization removed
            # anywhere, a module assigned anew): every parameter is looked for
            candidates = self._names
        else:
            for held_by, key, obj, _ in self._watched:
                if held_by.get(key) is not obj:
                    break
            else:
                return False
            candidates = [(p, name) for _, _, p, name in self._watched if name is not None]
        now = {id(q) for q in self.module.parameters()}
        swapped = False
        for p, name in candidates:
            if id(p) in now:
                continue
            # stages 1-2: a parameter this optimizer trains took its place (a new head given to add_param_group, a
            # weight tied to another): what backward reaches is trained, as torch.optim would
            there = self.param_at(name)
            if there is not None and not isinstance(there, nn.Parameter):
                # a plain tensor in its place: torch.func.functional_call (stateless reparametrization) swapped it in
                # for one call and puts the parameter back after it; looked at again then (the watch is kept)
                swapped = True
                continue
            if there is not None and there in trained and not shards_params:
                continue
            if there is None and not shards_params and p not in trained:
                continue  # stages 1-2: frozen when laid out, it holds no state here (peft's delete_adapter): as torch
            if there is None and self._parametrized(name):
                raise RuntimeError(
                    f"a parametrization registered on the model's {name} after the optimizer was built holds new "
                    "Parameters in place of the one the optimizer trains (weight_norm's original0 and original1; "
                    "one that keeps the Parameter, as spectral_norm or orthogonal do, is served): register it before "
                    "building the optimizer, or build a new one over model.parameters() (save and load its "
                    "state_dict() to keep the states)")
            if there is None:
                raise RuntimeError(
                    f"the model no longer holds its parameter {name} (its module deleted or assigned anew, a "
                    "parametrization removed: what it leaves is a new Parameter, or a buffer under torch.no_grad()): "
                    "the optimizer was built over it and would go on holding a tensor backward no longer reaches, "
                    "and train nothing new. Change the model before building the optimizer, or build a new one over "
                    "model.parameters() (save and load its state_dict() to keep the states)")
            holds = "would train the old tensor" if p in trained else \
                "would go on serving the old (frozen) tensor, " + ("gathering its shards into it, " if shards_params
                                                                    else "") + "while the model uses the new one"
            raise RuntimeError(
                f"the model's parameter {name} is no longer the one the optimizer was built over: another "
                "nn.Parameter took its place (model.to('meta') then to_empty(), a module or parameter assigned anew, "
                "load_state_dict(..., assign=True), a parametrization removed, resize_token_embeddings) and the "
                f"optimizer {holds}. "
                "Change the model before building the optimizer, or build a new one over model.parameters() (save "
                "and load its state_dict() to keep the states); to change values, assign p.data = t instead")
        if swapped:
            return False  # (watched afresh once the swapped-in tensors are gone)
        if flagged:
            self.watcher.changed = False  # looked at: the names are taken afresh
        self.watch(param_groups)
        return True

    def _holder(self, name: str) -> tuple[nn.Module | None, str]:
        """The module that holds dotted ``name`` now (None: gone) and the name's last part."""
        *path, leaf = name.split(".")
        m = self.module
        for key in path:
            m = m._modules.get(key)
            if m is None:
                return None, leaf
        return m, leaf

    def _parametrized(self, name: str) -> bool:
        """Whether the module holding dotted ``name`` has a parametrization of it (torch.nn.utils.parametrize)."""
        m, leaf = self._holder(name)
        return m is not None and parametrize.is_parametrized(m, leaf)

    def param_at(self, name: str):
        """The parameter the model holds at dotted ``name`` now, or None."""
        m, leaf = self._holder(name)
        return None if m is None else m._parameters.get(leaf)

    def close(self) -> None:
        """The watch ends: registrations on the model no longer reach this guard."""
        model_watch.unwatch(self.module, self.watcher)
