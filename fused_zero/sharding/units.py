"""Stage 3: which modules are units, and which unit owns each parameter.

A unit is a module whose parameters are gathered together just before its
forward and released after it. Unit 0 is always the model itself (the root):
it owns every parameter that no other unit owns, and stays gathered from the
start of a training forward to the end of its backward.

By default the units are the elements of every ``nn.ModuleList`` in the model
that hold parameters (transformer blocks), outermost first; a model without a
ModuleList gets one unit per direct child that holds parameters (the layers of a
child that is an ``nn.Sequential``, whose own forward a loop over its layers
skips). peft's wrappers (``PeftModel`` > ``LoraModel`` > model: ``PeftModel``'s
forward may call the model inside directly, past the ``LoraModel``'s, whose unit
would then never be gathered) are looked through: the model inside gets the units
it would get unwrapped. Other wrappers stay units (their forward may read a
child's weight directly: a tied head). ``units=``
overrides that with module classes (every instance below the root becomes a
unit) or with the module objects themselves.

A parameter belongs to the innermost unit around the module that registers
it. A parameter registered in several units (an embedding tied to the output
head) goes to the root, so it is gathered whenever any of its users runs.

Nothing here touches tensor data: modules in, a plan out.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from torch import nn


class UnitPlan(NamedTuple):
    """Units (index 0 the root) and the parameters each one owns, in model order.

    ``modules[i]`` holds the modules of unit ``i``: one, or several consecutive ones merged
    (``merge_small``); the root's is ``(model,)``.
    """

    modules: tuple[tuple[nn.Module, ...], ...]
    params: tuple[tuple[nn.Parameter, ...], ...]


def merge_small(sizes: Sequence[int], min_numel: int) -> list[range]:
    """Consecutive runs of ``sizes`` (the units below the root, model order): each run is as short as
    holds at least ``min_numel`` elements, except the last, which is added to the run before it when
    it alone holds fewer (a small tail is not left a unit of its own). ``min_numel`` 0: one unit each."""
    runs: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total >= min_numel:
            runs.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        if runs:
            runs[-1] = range(runs[-1].start, len(sizes))
        else:
            runs.append(range(start, len(sizes)))
    return runs


#: Modules whose forward never runs: hooks on them would never fire.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def default_units(model: nn.Module) -> list[nn.Module]:
    """Elements of ModuleLists holding parameters (outermost only), else the root's children."""
    found: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> None:
        if isinstance(m, nn.ModuleList):
            for child in m:
                if _has_params(child) and not isinstance(child, _CONTAINERS):
                    found.setdefault(id(child), child)  # a unit: no units inside it
                else:
                    visit(child)
            return
        for child in m.children():
            visit(child)

    visit(model)
    if not found:
        for child in _unwrapped(model).children():
            for c in _layers(child):
                if _has_params(c):
                    found.setdefault(id(c), c)
    return list(found.values())


def _unwrapped(m: nn.Module) -> nn.Module:
    """``m``, or below peft's wrappers (no parameters of their own, all of them in one child) the model they wrap:
    ``PeftModel``'s forward may call that model directly, past the ``LoraModel``'s, so a unit around the ``LoraModel``
    would never be gathered. Only peft's: another wrapper's forward may read a child's weight directly (a tied head,
    ``F.linear(h, self.emb.weight)``), which only a unit around the wrapper serves."""
    while type(m).__module__.split(".", 1)[0] == "peft" and not any(p is not None for p in m._parameters.values()):
        held = [c for c in m.children() if _has_params(c)]
        if len(held) != 1 or isinstance(held[0], _CONTAINERS):
            break
        m = held[0]
    return m


def _layers(m: nn.Module):
    """``m``, or where its own forward may never run, its layers: a container's elements, and an
    ``nn.Sequential``'s (a model may loop over a Sequential's layers to keep their outputs, VGG-style, and then
    the Sequential's forward, around which a unit is gathered, never runs; its layers run either way)."""
    if isinstance(m, (nn.Sequential, *_CONTAINERS)):
        for child in m.children():
            yield from _layers(child)
    elif not isinstance(m, _CONTAINERS):
        yield m


#: torch modules whose own forward reads their submodules' parameters without calling those submodules:
#: ``MultiheadAttention`` passes ``out_proj.weight`` to ``F.multi_head_attention_forward``, and
#: ``TransformerEncoderLayer``'s fast path (eval under ``no_grad``) passes every child's weights to one fused op.
#: A unit inside one would never be gathered when it is read: the weights belong to the unit around it.
_READS_CHILDREN = (nn.MultiheadAttention, nn.TransformerEncoderLayer)


def _inside_readers(model: nn.Module) -> dict[int, tuple[str, str, str]]:
    """For each module strictly inside a ``_READS_CHILDREN`` module of ``model``: (its name, the reader's name,
    the reader's class name)."""
    inside: dict[int, tuple[str, str, str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, _READS_CHILDREN):
            for sub, d in m.named_modules(prefix=name):
                if d is not m:
                    inside.setdefault(id(d), (sub, name or "the model", type(m).__name__))
    return inside


def check_units_form(units) -> None:
    """What ``units`` must be before the model is known (a framework's strategy takes it when made): None, or a list
    of nn.Module classes or of modules, not a mix; TypeError naming the fix otherwise."""
    if units is None:
        return
    if isinstance(units, (type, nn.Module, str, bytes)) or not isinstance(units, Sequence):
        raise TypeError("units must be a list of nn.Module classes or of submodules of the model, "
                        f"got {type(units).__name__}")
    classes = all(isinstance(u, type) and issubclass(u, nn.Module) for u in units)
    if not classes and not all(isinstance(u, nn.Module) for u in units):
        bad = [u for u in units if not (isinstance(u, nn.Module) or (isinstance(u, type) and issubclass(u, nn.Module)))]
        raise TypeError("units must be all nn.Module classes or all submodules of the model"
                        + (f"; got {bad[0]!r}" if bad else ", not a mix of both"))


def is_compiled(m: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper (an ``OptimizedModule``), told by name: importing Dynamo to ask costs."""
    return type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module)


def compiled_regions(model: nn.Module) -> dict[int, nn.Module]:
    """Each module inside a ``torch.compile`` wrapper placed below the root (torchtitan's per-block
    ``torch.compile(block, fullgraph=True)``, registered in place of the block) -> the outermost such wrapper.

    Dynamo traces the hooks of the modules inside into the block's graph, where stage 3's hooks (they gather
    and re-point parameters) can only be a graph break, an error under ``fullgraph=True``; the wrapper's own call
    runs eagerly, so hooks on it stay out of the graph, as FSDP2's on a block compiled before ``fully_shard``.
    A model compiled whole (the root a wrapper) keeps its units inside: one unit would gather it all."""
    regions: dict[int, nn.Module] = {}
    for m in model.modules():  # outer before inner: setdefault keeps the outermost wrapper
        if m is not model and is_compiled(m):
            for inner in m.modules():
                if inner is not m:
                    regions.setdefault(id(inner), m)
    return regions


def resolve_units(model: nn.Module, units) -> list[nn.Module]:
    """The unit modules below the root for ``units`` (None, classes or modules), model order. Modules inside one
    that reads their weights directly (``_READS_CHILDREN``) are no units: by default and for classes they are left
    to the unit around them (``units=[nn.Linear]`` makes every other Linear a unit); passed by themselves they are
    refused, naming the module to pass instead. A module inside a block compiled in place
    (``compiled_regions``) stands for that block's wrapper: the wrapper is the unit."""
    inside = _inside_readers(model)
    if units is None:
        chosen = [m for m in default_units(model) if id(m) not in inside]
    else:
        check_units_form(units)
        if all(isinstance(u, type) and issubclass(u, nn.Module) for u in units):
            classes = tuple(units)
            chosen = [m for m in model.modules() if m is not model and isinstance(m, classes) and id(m) not in inside]
        elif all(isinstance(u, nn.Module) for u in units):
            members = {id(m) for m in model.modules()}
            for u in units:
                if id(u) not in members:
                    raise ValueError(f"units contains a {type(u).__name__} that is not a submodule of the model; "
                                     "pass modules of the model the optimizer shards")
                if u is model:
                    raise ValueError("units must not contain the model itself: it is always the root unit")
                if id(u) in inside:
                    sub, reader, kind = inside[id(u)]
                    raise ValueError(
                        f"units contains {sub}, inside the {kind} {reader}, whose forward reads its weights directly "
                        "without calling it, so they would never be gathered when they are read: pass the "
                        f"{kind} (or a module around it) as the unit instead")
            chosen = list(units)
        for m in chosen:
            if isinstance(m, _CONTAINERS):
                raise ValueError(f"units contains a {type(m).__name__}, whose forward never runs, so its "
                                 "parameters would never be gathered; pass its elements instead "
                                 "(e.g. units=list(model.blocks))")
    regions = compiled_regions(model)
    chosen = [regions.get(id(m), m) for m in chosen]
    order = {id(m): i for i, m in enumerate(model.modules())}
    unique = {id(m): m for m in chosen}
    return sorted(unique.values(), key=lambda m: order[id(m)])


def plan_units(model: nn.Module, units=None, min_unit_numel: int = 0) -> UnitPlan:
    """Assign every parameter of ``model`` to one unit; drop units that own none; merge default units
    smaller than ``min_unit_numel`` elements with their neighbours (``merge_small``); where they all merge
    into one, the root holds them (a model smaller than about twice ``min_unit_numel``)."""
    candidates = [model] + resolve_units(model, units)
    index = {id(m): i for i, m in enumerate(candidates)}
    owners: dict[nn.Parameter, set[int]] = {}

    visited: set[tuple[int, int]] = set()

    def walk(m: nn.Module, unit: int) -> None:
        unit = index.get(id(m), unit)
        if (id(m), unit) in visited:
            return  # a shared module seen under this unit already (or a cycle)
        visited.add((id(m), unit))
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(p, set()).add(unit)
        for child in m._modules.values():
            if child is not None:
                walk(child, unit)

    walk(model, 0)
    owned: list[list[nn.Parameter]] = [[] for _ in candidates]
    for p in model.parameters():  # model order, each parameter once
        where = owners[p]
        owned[next(iter(where)) if len(where) == 1 else 0].append(p)
    keep = [i for i in range(1, len(candidates)) if owned[i]]
    if units is None and min_unit_numel > 0:
        runs = merge_small([sum(p.numel() for p in owned[i]) for i in keep], min_unit_numel)
    else:
        runs = [range(k, k + 1) for k in range(len(keep))]
    groups = [[keep[k] for k in run] for run in runs]
    if units is None and min_unit_numel > 0 and len(groups) == 1 and len(keep) > 1:
        # the merged units are the whole model below the root: one unit gathered from its first module's forward
        # to the end of backward is the root's life, so the root holds it, with no hook on each module of it
        # (bench_host's 200 blocks at stage 3: 1.24 -> 1.12x torch's fused AdamW)
        return UnitPlan(((model,),), (tuple(model.parameters()),))
    return UnitPlan(((model,),) + tuple(tuple(candidates[i] for i in g) for g in groups),
                    (tuple(owned[0]),) + tuple(tuple(p for i in g for p in owned[i]) for g in groups))
