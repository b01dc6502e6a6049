"""torch.optim.AdamW's arguments: the checks, wording and defaults of torch itself, and what a parameter must be.

ShardedOptimizer takes AdamW's whole signature so that code written for
torch.optim.AdamW (and the frameworks that build it from a config) works
unchanged; options that cannot mean anything here are refused with the reason.
"""
from __future__ import annotations

import collections.abc
import numbers
import re

import torch

from .host_read import to_host


def _scalar(value, what: str):
    """torch's check of a Tensor lr, for every hyperparameter (a multi-element eps or weight_decay met torch's
    "Boolean value of Tensor with more than one value is ambiguous" in the range checks)."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {what} must be 1-element: give {what} as a number or a one-element tensor, got a "
                         f"tensor of shape {tuple(value.shape)}")
    return value


def check_hyperparameters(lr, betas, eps, weight_decay) -> tuple:
    """torch.optim.Adam's value checks; returns betas as a tuple of floats or 0-d tensors."""
    _scalar(lr, "lr")
    _scalar(eps, "eps")
    _scalar(weight_decay, "weight_decay")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if isinstance(betas, (set, frozenset, collections.abc.Mapping)):  # no order: torch's betas[0] fails on them
        raise TypeError(f"betas must be a pair (beta1, beta2), e.g. (0.9, 0.999), got {type(betas).__name__} "
                        f"{betas!r}, which has no order: give a tuple")
    try:
        b0, b1 = betas
    except TypeError:  # not a sequence (0.9, None): torch's TypeError ("'float' object is not subscriptable")
        raise TypeError(f"betas must be a pair (beta1, beta2), e.g. (0.9, 0.999), got {type(betas).__name__} "
                        f"{betas!r}") from None
    except ValueError:  # a sequence of another length
        raise ValueError(f"betas must be a pair (beta1, beta2), e.g. (0.9, 0.999), got {betas!r}") from None
    if isinstance(b0, torch.Tensor) != isinstance(b1, torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    _scalar(b0, "betas[0]")
    _scalar(b1, "betas[1]")
    if not 0.0 <= b0 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b0}")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b1}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    # as torch.optim.Adam keeps them: floats as given, tensors as 0-d tensors (read each step, so a schedule
    # that fills them in place is followed)
    return tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() else
                 b if isinstance(b, torch.Tensor) else float(b) for b in (b0, b1))


def kept_betas(given, checked: tuple):
    """A param group's betas as torch keeps them: the list or tuple given, where it holds numbers or 0-d tensors
    (the step reads it each time, so an edit in place is followed, ints included), else ``checked``. (The
    constructor's default is always ``checked``, a tuple of its own, as torch's: groups never share the caller's
    list.)"""
    if isinstance(given, (tuple, list)) and all(
            (isinstance(b, torch.Tensor) and b.dim() == 0) or (isinstance(b, numbers.Real) and not isinstance(b, bool))
            for b in given):
        return given
    return checked


def check_foreach_tensors(lr, betas, foreach, capturable) -> None:
    """torch.optim.AdamW's constructor refuses a Tensor lr or betas with foreach=True unless capturable (its foreach
    path reads them as numbers): refused here alike, in its words, though fused_zero's update takes them either way
    (foreach= changes nothing here; leave it out)."""
    if not foreach or capturable:
        return
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    if isinstance(betas, (tuple, list)):
        for i, beta in enumerate(betas[:2]):
            if isinstance(beta, torch.Tensor):
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")


def check_flags(foreach, fused, capturable, differentiable, optimizer_capturable: bool = False) -> None:
    """AdamW's implementation flags: fused_zero always runs its own fused update. ``capturable`` (a group's entry)
    must be the optimizer's own setting, made when it is built (``optimizer_capturable``; step_graph.py)."""
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if capturable is not None and bool(capturable) != optimizer_capturable:
        raise ValueError(f"capturable={bool(capturable)} is not supported in a param group of an optimizer built with "
                         f"capturable={optimizer_capturable}: capturable is the whole optimizer's setting (with True "
                         "it captures its step's device work as one CUDA graph), made when it is built; build it "
                         f"with ShardedOptimizer(..., capturable={bool(capturable)}), or leave the group's entry as "
                         "the optimizer's")
    if fused and differentiable:  # torch's words and type
        raise RuntimeError("`fused` does not support `differentiable`")
    if differentiable:
        raise ValueError("differentiable=True is not supported: the sharded update runs outside autograd; "
                         "use differentiable=False")


def check_group(group: dict, capturable: bool = False) -> None:
    """A param group's hyperparameters, as added or edited by the user (``capturable``: the optimizer's)."""
    group["betas"] = kept_betas(group["betas"], check_hyperparameters(group["lr"], group["betas"], group["eps"],
                                                                      group["weight_decay"]))
    check_flags(group.get("foreach"), group.get("fused"), group.get("capturable"), group.get("differentiable"),
                capturable)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")  # what a default repr holds


def agreement_key(value):
    """What ranks compare of a group or option value (``repr`` of it must be equal on every rank that agrees).

    Exact for what the update reads: numbers and strings as their repr, tensors as dtype, shape and values (a
    tensor on an accelerator read once, as the step reads it; never its device index, which is each rank's
    own); containers element by element; other numbers (numpy scalars, Fraction) by value. Any other object (a
    callable, a user object kept in a group as torch.optim allows) by its repr, unless that holds a memory
    address (the default repr, different on every rank): then by its type only.
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, numbers.Number):  # numpy.float32(1e-3), Fraction(1, 1000), ...
        return type(value).__name__, repr(complex(value) if isinstance(value, numbers.Complex)
                                          and not isinstance(value, numbers.Real) else float(value))
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            try:
                values = as_float(value)
            except (RuntimeError, NotImplementedError):  # a meta tensor: no value to compare (the step refuses
                values = ("unreadable", value.device.type)  # it, on this rank perhaps alone: read_hypers)
        else:
            values = tuple(value.flatten().tolist()) if value.device.type == "cpu" else value.device.type  # host tensor
        return ("tensor", str(value.dtype), tuple(value.shape), values)
    if isinstance(value, (tuple, list)):
        return tuple(agreement_key(v) for v in value)
    if isinstance(value, dict):  # (quoted name, value) pairs: a difference is reported by name
        return tuple(sorted((repr(k), agreement_key(v)) for k, v in value.items()))
    if isinstance(value, torch.device):
        return "device", value.type
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    text = repr(value)
    return "object", kind, None if _ADDRESS.search(text) else text


def as_float(value) -> float:
    """A hyperparameter as the kernels take it (a 1-element tensor lr from a scheduler included)."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    return float(value.item() if value.device.type == "cpu" else to_host(value, "tensor hyperparameter"))  # host tensor


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FROZEN_ONLY = (torch.float64,)  # besides the integer types: kept, never updated (frozen.py)


def check_param(p: torch.Tensor, name: str, first_device: torch.device) -> None:
    """A parameter the sharded optimizer can lay out in its flat buffers."""
    if hasattr(p, "placements") and hasattr(p, "to_local"):  # a DTensor (torch's tensor parallel, FSDP2's shards)
        raise TypeError(f"parameter {name} is a DTensor ({type(p).__name__} with placements {tuple(p.placements)}): "
                        "ShardedOptimizer lays out plain tensors. For tensor parallelism, shard the layers by hand "
                        "(each rank's own plain nn.Parameter of its slice: README, mesh) and pass mesh['dp'], or "
                        "train DTensor parameters with FSDP2 and a torch optimizer")
    if p.is_sparse or p.layout != torch.strided:
        raise TypeError(f"parameter {name} is sparse ({p.layout}); ShardedOptimizer needs dense parameters")
    if p.is_complex() and not p.requires_grad:
        raise TypeError(f"parameter {name} is complex ({p.dtype}) and frozen: ShardedOptimizer lays out every "
                        "parameter of the model it is given, frozen ones too (stage 3 shards them), in float32, "
                        "bfloat16, float16, float64 or an integer type. Hold a fixed complex tensor as a buffer "
                        "(module.register_buffer), or keep it real: nn.Parameter(torch.view_as_real(w), "
                        "requires_grad=False) with torch.view_as_complex(...) in forward")
    if p.is_complex():
        raise TypeError(f"parameter {name} is complex ({p.dtype}); ShardedOptimizer supports float32, "
                        "bfloat16 and float16: keep the parameter real, nn.Parameter(torch.view_as_real(w)), and "
                        "use torch.view_as_complex(self.weight) in forward (AdamW then steps real and imaginary "
                        "parts apart, as torch's does for complex parameters)")
    if p.dtype not in _DTYPES and (p.requires_grad or p.is_floating_point() and p.dtype not in _FROZEN_ONLY):
        raise TypeError(f"parameter {name} has dtype {p.dtype}; ShardedOptimizer trains float32, bfloat16 and "
                        "float16 parameters (a frozen one, requires_grad=False, may also be float64 or an integer "
                        "type, as a quantized base model's weights): convert it (model.float()), or freeze it "
                        "before building the optimizer")
    grad_dtype = getattr(p, "grad_dtype", None)  # torch >= 2.13: gradients accumulated in another dtype
    if p.requires_grad and grad_dtype is not None and grad_dtype != p.dtype:
        raise TypeError(f"parameter {name} has grad_dtype {grad_dtype} (its dtype is {p.dtype}): ShardedOptimizer "
                        "takes gradients of the parameter's own dtype, and keeps the fp32 master itself (bf16 "
                        "parameters: reduce_dtype=torch.float32 reduces in fp32). Leave grad_dtype unset")
    if p.device.type == "meta":
        raise ValueError(f"parameter {name} is on the meta device: materialize the model (model.to_empty("
                         "device=...) and initialise it) before building the optimizer")
    if p.device != first_device:
        raise ValueError(f"parameter {name} is on {p.device} but the first parameter is on {first_device}; "
                         "move the model to one device before building the optimizer")
