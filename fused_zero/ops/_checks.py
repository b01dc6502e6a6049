"""Argument checks shared by the public ops: clear errors naming the fix."""
from __future__ import annotations

from collections.abc import Iterable
from numbers import Real

import torch

F32 = (torch.float32,)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_flat(name: str, t: object, dtypes: Iterable[torch.dtype]) -> torch.Tensor:
    """``t`` must be a dense, contiguous, 1-D tensor of one of ``dtypes``."""
    dtypes = tuple(dtypes)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    _check_dtype(name, t, dtypes)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a flat 1-D buffer, got shape {tuple(t.shape)}; pass .view(-1)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass .contiguous() or a flat buffer")
    return t


def _check_dtype(name: str, t: torch.Tensor, dtypes: tuple) -> None:
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")


def check_same_numel(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.numel() != ref.numel():
            raise ValueError(
                f"{name} has {t.numel()} elements but {ref_name} has {ref.numel()}; "
                "all buffers of one call must have the same size"
            )


def check_same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                "move them to one device"
            )


def check_no_overlap(**tensors: torch.Tensor | None) -> None:
    """Distinct output buffers must not share memory."""
    items = [(n, t) for n, t in tensors.items() if t is not None and t.numel() > 0]
    for i, (na, a) in enumerate(items):
        a0 = a.data_ptr()
        a1 = a0 + a.numel() * a.element_size()
        for nb, b in items[i + 1:]:
            b0 = b.data_ptr()
            b1 = b0 + b.numel() * b.element_size()
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{na} and {nb} overlap in memory; pass separate buffers")


def check_real(name: str, value: object, lo: float, hi: float | None = None) -> None:
    """``value`` must be a Python real number in [lo, hi) (or [lo, inf) without hi)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    value = float(value)
    if hi is None and not value >= lo:  # also rejects NaN
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and not lo <= value < hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}), got {value}")


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_scalar_tensor(name: str, t: torch.Tensor, dtypes: Iterable[torch.dtype],
                        device: torch.device) -> None:
    """``t`` must hold one element of one of ``dtypes``, on ``device``."""
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one element (a 0-d tensor), got shape {tuple(t.shape)}")
    _check_dtype(name, t, tuple(dtypes))
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but param is on {device}; move it to {device}")
