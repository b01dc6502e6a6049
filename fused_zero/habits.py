"""Detect the habits of torch, DDP and FSDP users that a sharded optimizer cannot serve.

Each check returns a message naming the fix, or None; the optimizer raises it on
every rank. They run once (at the first backward or step), never per step.
"""
from __future__ import annotations

import dis
import gc
import os
import sys
import types

import torch

from .ownership import held


_DDP = ("the model is wrapped in DistributedDataParallel: do not wrap the model in "
        "DistributedDataParallel, ShardedOptimizer averages gradients itself (DDP would reduce "
        "them a second time and fight over .grad). Pass the bare model. HF Trainer, Lightning "
        "and Accelerate wrap it in DDP themselves: use their fused_zero integration instead, "
        "fused_zero.integrations.transformers.ZeroTrainer, "
        "L.Trainer(strategy=fused_zero.integrations.lightning.ZeroStrategy(stage=...)), or "
        "fused_zero.integrations.accelerate.ZeroAccelerator in place of accelerate.Accelerator")


STAGE1_GRADS_EDITED = (
    "ShardedOptimizer stage 1: .grad was changed in place between backward and step(), but at stage 1 .grad "
    "holds each rank's local gradient (averaged at step): a norm clipped from it (torch.nn.utils.clip_grad_norm_) "
    "is this rank's, not the global one. Clip with optimizer.clip_grad_norm_(max_norm) or max_grad_norm=")


#: clip_grad_norm_ / max_grad_norm over mesh["dp"] of a larger mesh (tensor or pipeline parallel beside it)
CLIP_OVER_DP_ONLY = (
    "ShardedOptimizer over a sub-mesh of a larger mesh (mesh['dp'] of a tp x dp mesh): {what} measures the norm of "
    "the gradients on this data-parallel group only. The other dimensions' ranks (tensor or pipeline parallel) hold "
    "other slices of the model, whose shares are not summed, so each clips with its own norm and parameters they "
    "all hold drift apart (README: Meshes). Warned once")

STEP_WITHOUT_ZERO_GRAD = (
    "ShardedOptimizer stage {stage}: step() again with no zero_grad() since the last step. torch would still "
    "hold the last step's gradients on .grad and add this step's backward to them (or, with no backward since, step "
    "on them again); at stages 2-3 the averaged gradients live in the optimizer's shards and each step consumes "
    "them, as if zero_grad() had run after it. Call optimizer.zero_grad() (or model.zero_grad()) once per step, and "
    "accumulate micro-batches with optimizer.no_sync(). (A loop that sets p.grad = None itself zeroes them too: "
    "call optimizer.zero_grad() instead to silence this.) Warned once")


def ddp_reduced() -> set[int]:
    """The ids of the parameters a live DistributedDataParallel reduces.

    One scan of the garbage collector's objects for DDP instances (done once, at the first
    gradient, and only where several ranks run): DDP keeps the parameters it reduces in
    ``_module_parameters``.
    """
    ddp_type = torch.nn.parallel.DistributedDataParallel
    reduced = set()
    for obj in gc.get_objects():
        # type(), not isinstance(): the heap holds weak proxies, whose isinstance() raises once dead
        if issubclass(type(obj), ddp_type):
            reduced.update(id(p) for p in getattr(obj, "_module_parameters", ()))
    return reduced


def ddp_wrapping(params: list[torch.nn.Parameter], reduced: set[int]) -> str | None:
    """A message if a live DistributedDataParallel reduces any of ``params`` (``reduced``: ``ddp_reduced()``)."""
    return _DDP if any(id(p) in reduced for p in params) else None


def left_unreduced(module: torch.nn.Module, reduced: set[int]) -> str | None:
    """A message if trainable parameters of ``module`` (the model given as ``module=``, stages 1-2) are averaged
    across ranks by no fused_zero optimizer and no DistributedDataParallel (``reduced``: ``ddp_reduced()``):
    trained by a torch optimizer (a head, a learnable loss temperature), each rank's copy follows its own gradient
    and the ranks drift apart, where DDP over the whole model would have averaged them. Called once, at the first
    gradient."""
    left = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in reduced and not held(p)]
    if not left:
        return None
    shown = ", ".join(repr(n) for n in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
    return (f"{len(left)} trainable parameters of the model given as module= ({shown}) are in no param group of "
            "a fused_zero optimizer and no DistributedDataParallel reduces them: their gradients are not averaged "
            "across ranks, so another optimizer that trains them lets each rank's copy drift apart. Put them in a "
            "param group (with their own options if needed), or in a second ShardedOptimizer, or wrap that part "
            "of the model in DistributedDataParallel; freeze them (requires_grad_(False)) if they are not trained")


def torchrun_without_process_group() -> str | None:
    """A message if a launcher started several ranks but no process group is initialised."""
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        many = int(world) > 1
    except ValueError:
        return None
    if many:
        return (f"WORLD_SIZE={world} (torchrun or another launcher started {world} ranks) but torch.distributed "
                "is not initialised, so every rank would train alone on its own data: call "
                "torch.distributed.init_process_group() before building the optimizer (or pass process_group=)")
    return None


def group_initialised_after_build(world_size: int) -> str:
    """The message when the default process group came up after a single-rank optimizer was built."""
    return (f"this ShardedOptimizer was built before torch.distributed.init_process_group(), so it trains this rank "
            f"alone, but the default process group now has {world_size} ranks: every rank would train on its own "
            "data, unaveraged. Build the optimizer after init_process_group() (or pass process_group= explicitly, "
            "a one-rank group to train alone on purpose)")


def _calling_code(depth: int = 64):
    """(file, function) of each calling frame, innermost first.

    Only code objects are read, never ``frame.f_locals``: on Python 3.11-3.12 reading it caches a
    snapshot of the frame's locals on the frame, which would keep an optimizer a caller has since
    dropped alive.
    """
    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        yield frame.f_code.co_filename.replace(os.sep, "/"), frame.f_code.co_name
        frame, depth = frame.f_back, depth - 1


def lightning_without_strategy() -> str | None:
    """A message if a Lightning strategy other than ZeroStrategy is building this optimizer.

    Lightning calls ``configure_optimizers`` from its strategy's ``setup_optimizers``: that frame is
    on the stack while the optimizer is built (ZeroStrategy builds it from its own code instead).
    Lightning's own strategies clip and accumulate through ``.grad`` and DDP, never call the
    module's forward (stage 3 gathers there) and save the optimizer's (collective) state_dict on
    one rank: each would train silently wrong or hang. Costs nothing unless lightning is
    imported; then a walk up the calling frames.
    """
    if "lightning" not in sys.modules and "pytorch_lightning" not in sys.modules:
        return None
    frames = list(_calling_code())
    if any("/fused_zero/integrations/" in path for path, _ in frames):
        return None  # ZeroStrategy is setting up: it checks what configure_optimizers returned itself
    for path, name in frames:
        if name == "setup_optimizers" and ("/lightning/" in path or "/pytorch_lightning/" in path):
            return ("a Lightning strategy other than ZeroStrategy is building this ShardedOptimizer (from "
                    "configure_optimizers): Lightning's own strategies clip and accumulate through .grad and DDP, "
                    "never call forward (stage 3 gathers there) and save the optimizer's (collective) state_dict "
                    "on one rank, so it would train wrong. Use L.Trainer(strategy=fused_zero.integrations."
                    "lightning.ZeroStrategy(stage=...)) and return torch.optim.AdamW (or Adam) from "
                    "configure_optimizers: the strategy builds the ShardedOptimizer")
    return None


def _trainer_on_stack(frames) -> bool:
    return any(path.endswith("/transformers/trainer.py") for path, _ in frames)


_PLAIN_TRAINER = ("a plain transformers.Trainer steps this ShardedOptimizer: Trainer clips .grad (None at stages "
                  "2-3, each rank's own at stage 1), so it would train silently wrong. Use fused_zero.integrations."
                  "transformers.ZeroTrainer(..., zero=fused_zero.ZeroConfig(stage=...)) (it builds the optimizer "
                  "from TrainingArguments, or takes yours through optimizers=)")
_PLAIN_ACCELERATOR = ("a plain accelerate.Accelerator prepared this ShardedOptimizer: its clip_grad_norm_ clips .grad "
                      "(None at stages 2-3) and its no_sync does not reach the optimizer, so it would train silently "
                      "wrong. Use fused_zero.integrations.accelerate.ZeroAccelerator(zero=fused_zero.ZeroConfig("
                      "stage=...)) in place of Accelerator, and pass it the model with a torch.optim.AdamW")

_FABRIC = ("Lightning Fabric steps this ShardedOptimizer (fabric.setup_optimizers): Fabric is not supported. Its "
           "clip_gradients clips .grad (None at stages 2-3: nothing would be clipped; each rank's own at stage 1), "
           "fabric.no_backward_sync does not reach the optimizer, and fabric.setup(model) wraps the model in DDP. "
           "Use lightning's Trainer with strategy=fused_zero.integrations.lightning.ZeroStrategy(stage=...), or a "
           "plain loop under torchrun that steps the ShardedOptimizer itself (optimizer.clip_grad_norm_, "
           "optimizer.no_sync())")


def stage3_model_wrapped(optimizer, module) -> str | None:
    """A message if DDP, or a plain Accelerator (an HF Trainer's included), drives the model that
    ``optimizer`` shards at stage 3 (called at the model's first training forward, before any gather).

    Such a run fails in its first backward with an autograd shape error naming nothing (DDP's
    reducer and the frameworks' clipping read full-size .grad of parameters that are released
    placeholders), at any world size: with a process group, Accelerate wraps even one rank in DDP.
    ZeroAccelerator (under ZeroTrainer too) marks its optimizers and never wraps in DDP.
    """
    if optimizer.integrated:
        return None
    frames = list(_calling_code())
    ddp = any(path.endswith("/torch/nn/parallel/distributed.py") for path, _ in frames)
    prepared = "accelerate" in sys.modules and getattr(module, "_is_accelerate_prepared", False)
    if _trainer_on_stack(frames) and (ddp or prepared):
        return _PLAIN_TRAINER
    if prepared or (ddp and any("/accelerate/" in path for path, _ in frames)):
        return _PLAIN_ACCELERATOR
    return _DDP if ddp else None


def _is_adalora(m) -> bool:
    return any(c.__name__ == "AdaLoraLayer" for c in type(m).__mro__)


def adalora_unserved(module, stage: int, world_size: int, params=()) -> str | None:
    """A message if ``module`` holds peft AdaLoRA layers where their rank allocator cannot be served.

    ``update_and_allocate()`` (called after ``step()``, before ``zero_grad()``) scores each adapter
    weight by ``p * p.grad`` and masks the least important ones in place: it needs the averaged
    gradient on ``.grad`` (peft reads DeepSpeed's through ``safe_get_full_grad``). At stage 1 ``.grad``
    is each rank's local gradient, so on 2+ ranks every rank masks other entries and the replicas
    drift apart silently; at stages 2-3 it is None (peft fails with a bare TypeError). Found by the
    layers' class name (peft is never imported here): in ``module``, or, given only ``params``, among the live
    modules once peft's AdaLoRA is imported (one scan of the collector's objects, at build).
    """
    if stage == 1 and world_size == 1:
        return None
    if module is not None:
        if not any(_is_adalora(m) for m in module.modules()):
            return None
    elif "peft.tuners.adalora" not in sys.modules or not any(p.dim() == 2 and p.shape[1] == 1 for p in params):
        return None  # (AdaLoRA's singular values, lora_E, are (r, 1): no such parameter, no AdaLoRA layer)
    else:  # given the parameters only (the one-line swap): a live AdaLoRA layer holding one of them (once, at build)
        ids = {id(p) for p in params}
        # type(), not isinstance(): the heap holds weak proxies, whose isinstance() raises once dead
        if not any(issubclass(type(obj), torch.nn.Module) and _is_adalora(obj)
                   and any(id(p) in ids for p in obj.parameters()) for obj in gc.get_objects()):
            return None
    where = (f"stage 1 on {world_size} ranks, where .grad holds each rank's local gradient (the ranks would mask "
             "different entries and drift apart)") if stage == 1 else \
        f"stage {stage}, where .grad is None after backward (the averaged gradient lives in the shards)"
    return (f"the model holds peft AdaLoRA layers: AdaLoRA's update_and_allocate() scores every adapter weight by "
            f"p * p.grad after step() and needs the averaged gradient on .grad, which ShardedOptimizer does not "
            f"keep at {where}. Train AdaLoRA with stage 1 on one process, or with DistributedDataParallel and a "
            f"torch optimizer; other peft adapters (LoRA, DoRA, IA3, ...) are served at every stage")


def framework_without_integration(optimizer) -> str | None:
    """A message if Accelerate's AcceleratedOptimizer, as a plain Accelerator or HF Trainer made it, or
    Lightning Fabric's optimizer wrapper is stepping ``optimizer`` (called from ``step()``, once).

    Trainer clips through ``accelerator.clip_grad_norm_(model.parameters())``, i.e. over ``.grad``
    (each rank's local gradient at stage 1, None at stages 2-3: nothing is clipped), and a plain
    Accelerator's ``clip_grad_norm_`` and ``no_sync`` do the same: both would train silently wrong.
    ZeroAccelerator (under ZeroTrainer too) marks the optimizers it prepares. Costs nothing unless
    accelerate is imported; then a walk up the calling frames.
    """
    if optimizer.integrated or not {"accelerate", "lightning.fabric", "lightning_fabric"} & sys.modules.keys():
        return None
    frames = list(_calling_code())
    if any(name == "step" and path.endswith(("/lightning/fabric/wrappers.py", "/lightning_fabric/wrappers.py"))
           for path, name in frames):
        return _FABRIC
    if not any(name == "step" and path.endswith("/accelerate/optimizer.py") for path, name in frames):
        return None
    return _PLAIN_TRAINER if _trainer_on_stack(frames) else _PLAIN_ACCELERATOR


_LIBRARY = (os.sep + "torch" + os.sep, os.sep + "fused_zero" + os.sep, "site-packages", "dist-packages")
_CLIP_CALLERS: dict = {}  # code object -> whether it calls torch.nn.utils.clip_grad_norm_


def _calls_torch_clip(frame) -> bool:
    """Whether the code of ``frame`` names torch's clip_grad_norm_ (read from its bytecode once, not run): loads a
    global bound to it (``from torch.nn.utils import clip_grad_norm_ as clip`` at the top), import it inside the
    function, or read ``clip_grad_norm_`` off ``utils`` / ``clip_grad`` (``torch.nn.utils.clip_grad_norm_``) or off
    a name bound to either module (at the top or by an import inside). ``opt.clip_grad_norm_`` (the optimizer's
    own), ``accelerator.clip_grad_norm_`` and ``torch.utils.checkpoint`` in the same loop are not."""
    code = frame.f_code
    found = _CLIP_CALLERS.get(code)
    if found is None:
        found = _names_torch_clip(code, frame.f_globals)
        _CLIP_CALLERS[code] = found
    return found


_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_FAST_CHECK")
_STORES = ("STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF")


def _names_torch_clip(code, g: dict, helpers: int = 1) -> bool:
    """Whether ``code`` names torch's clip (``clip_grad_norm_``, or ``clip_grads_with_norm_`` after a norm of its
    own), or, ``helpers`` levels deep, calls a function of its own whose code does (torchtitan's
    ``dist_utils.clip_grad_norm_``: ``get_total_norm`` + ``clip_grads_with_norm_``)."""
    modules = set()  # names an import inside the function bound to torch.nn.utils or its clip_grad module
    importing = None  # what the import being read brings: the last module or name it named
    before = None
    for ins in dis.get_instructions(code):
        op, arg = ins.opname, ins.argval
        if op == "IMPORT_NAME":
            importing = str(arg).rsplit(".", 1)[-1] if str(arg).startswith("torch") else None
        elif op == "IMPORT_FROM" and importing is not None:
            if arg in _CLIP_NAMES:
                return True
            importing = arg
        elif op in _STORES and importing is not None:
            if importing in ("utils", "clip_grad"):
                modules.add(arg)
            importing = None
        elif op in ("LOAD_GLOBAL", "LOAD_NAME"):
            if any(g.get(arg) is f for f in _TORCH_CLIPS):
                return True
            if helpers and _helper_clips(g.get(arg), helpers):
                return True
        elif op in ("LOAD_ATTR", "LOAD_METHOD") and before is not None:
            if arg in _CLIP_NAMES:
                if before.opname in ("LOAD_ATTR", "LOAD_METHOD") and before.argval in ("utils", "clip_grad"):
                    return True
                if before.opname in _LOADS and (before.argval in modules
                                                or any(g.get(before.argval) is m for m in _CLIP_MODULES)):
                    return True
            # a helper read off a module of the loop's globals (``dist_utils.clip_grad_norm_``)
            if helpers and before.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(
                    g.get(before.argval), types.ModuleType):  # (its __dict__: a lazy module's __getattr__ imports)
                if _helper_clips(vars(g[before.argval]).get(str(arg)), helpers):
                    return True
        before = ins
    return False


def _helper_clips(fn, helpers: int) -> bool:
    """Whether ``fn`` is a clip helper (a Python function outside torch and fused_zero, named for clipping:
    ``clip_grad_norm_``, ``clip_gradients``) whose code names torch's clip. Other functions the loop calls are not
    read: a phase of the script that trains another model with torch's clip is no clip of this optimizer's."""
    if not isinstance(fn, types.FunctionType) or "clip" not in fn.__name__.lower():
        return False
    code = fn.__code__
    if any(part in code.co_filename for part in _LIBRARY[:2]):
        return False
    key = (code, helpers)
    found = _CLIP_CALLERS.get(key)
    if found is None:
        _CLIP_CALLERS[key] = False  # (recursion)
        found = _CLIP_CALLERS[key] = _names_torch_clip(code, fn.__globals__, helpers - 1)
    return found


_TORCH_CLIPS = tuple(f for f in (getattr(torch.nn.utils, "clip_grad_norm_", None),
                                 getattr(torch.nn.utils, "clip_grads_with_norm_", None)) if f is not None)
_CLIP_NAMES = ("clip_grad_norm_", "clip_grads_with_norm_")
_CLIP_MODULES = (torch.nn.utils, torch.nn.utils.clip_grad)


def torch_clip_in_loop() -> tuple[str, int] | None:
    """(A message, the warning's stacklevel from step()) if the user code that called step() clips with
    torch.nn.utils.clip_grad_norm_.

    At stages 2-3 ``.grad`` is None after backward (the averaged gradients live in the shards), so
    torch's clip finds nothing, returns 0 and clips nothing. The first frames outside torch,
    fused_zero and installed packages (up to ``_USER_FRAMES``: a scheduler's or GradScaler's wrapper
    sits between, or the loop's own optimizer container) are the training loop; their code, and that of
    the functions of their own they call (a clip helper), is read once, not per step.
    """
    frame, users = sys._getframe(2), 0
    for up in range(12):
        if frame is None or users == _USER_FRAMES:
            return None
        if not any(part in frame.f_code.co_filename for part in _LIBRARY):
            users += 1
            if not _calls_torch_clip(frame):
                frame = frame.f_back
                continue
            return ("torch.nn.utils.clip_grad_norm_(model.parameters(), ...) clips nothing at ZeRO stages 2-3 "
                    "where given this optimizer's parameters: after backward their .grad is None (the averaged "
                    "gradients live in the optimizer's shards), so it returns 0 and the step runs unclipped. Clip "
                    "with optimizer.clip_grad_norm_(max_norm) (every rank calls it; it returns the global norm) or "
                    "build with max_grad_norm=. (This loop calls torch's clip; if it clips only another model's "
                    "parameters, ignore this)", 2 + up)
        frame = frame.f_back
    return None


#: User frames above step() read for torch's clip: the loop may step through a container of its own
#: (torchtitan's ``OptimizersContainer.step``) called from the function that clips
_USER_FRAMES = 3
