"""A JSON codec for what optimizers and schedulers hold, and the small files ("blobs") that use it.

``decode(encode(x))`` rebuilds tuples, small tensors, inf/nan and non-str dict keys exactly;
what JSON cannot hold goes to a torch file that ``torch.load(weights_only=True)`` reads.
"""
from __future__ import annotations

import io
import json
import math
import re
from typing import Any

import torch


class NotJSON(TypeError):
    """The value holds something the JSON codec does not represent exactly."""


_TENSOR_JSON_MAX = 64  # larger tensors go to a weights_only torch file instead


def encode(obj: Any, exact: bool = False) -> Any:
    """A JSON-able form of ``obj``: tuples, small tensors, inf/nan and non-str dict keys are tagged.

    ``exact``: refuse (NotJSON) a container that would come back as another type: a subclass of dict, list or
    tuple (``collections.Counter`` in MultiStepLR's milestones, an OrderedDict, a NamedTuple), whose methods the
    loader calls. (A number stays a number: a numpy float, as ReduceLROnPlateau keeps a metric, comes back a
    Python float.)"""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if exact and isinstance(obj, (tuple, list, dict)) and type(obj) not in (tuple, list, dict):
        raise NotJSON(f"{type(obj).__name__} would come back as a plain {type(obj).__mro__[-2].__name__}")
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, exact) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, exact) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, exact) for k, v in obj.items()}
        return {"__dict__": [[encode(k, exact), encode(v, exact)] for k, v in obj.items()]}
    if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.numel() <= _TENSOR_JSON_MAX
            and obj.layout == torch.strided and not obj.is_complex() and not obj.requires_grad):
        return {"__tensor__": encode(obj.tolist()), "dtype": str(obj.dtype).removeprefix("torch."),  # host tensor
                "shape": list(obj.shape)}
    raise NotJSON(f"{type(obj).__name__} is not represented in JSON")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {_hashable(decode(k)): decode(v) for k, v in obj["__dict__"]}
    if "__tensor__" in obj:
        return torch.tensor(decode(obj["__tensor__"]), dtype=getattr(torch, obj["dtype"])).reshape(obj["shape"])
    return {k: decode(v) for k, v in obj.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


def json_ok(obj: Any) -> bool:
    """Whether ``encode`` represents ``obj`` exactly (so that ``decode(encode(obj))`` rebuilds it, types included)."""
    try:
        encode(obj, exact=True)
    except NotJSON:
        return False
    return True


def _unpickler_reason(error: Exception) -> str:
    """The line of torch.load's weights_only error that names what it refused (the global), without the rest of
    torch's advice or its terminal escape codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    named = [line for line in lines if "WeightsUnpickler error" in line]
    return named[0].split(". Please use")[0] if named else next((line for line in lines if line), type(error).__name__)


def to_blob(obj: Any, stem: str, what: str) -> tuple[str, bytes]:
    """(file name, bytes): ``obj`` as JSON, or else a torch file that torch.load(weights_only=True) reads (which
    keeps a Counter or an OrderedDict what it is), or else as JSON with such containers made plain (a
    ``defaultdict``, which torch does not load, comes back a dict)."""
    if json_ok(obj):
        return stem + ".json", json.dumps(encode(obj, exact=True)).encode()
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        try:
            return stem + ".json", json.dumps(encode(obj)).encode()
        except NotJSON:
            pass
        raise TypeError(f"{what} holds objects that neither JSON nor torch.load(weights_only=True) can restore "
                        f"({_unpickler_reason(e)}); keep it to tensors, Python numbers, strings, lists, tuples and "
                        "dicts (a numpy scalar: float(x) or int(x))") from None
    return stem + ".pt", buf.getvalue()


def from_blob(name: str, data: bytes) -> Any:
    return decode(json.loads(data)) if name.endswith(".json") else torch.load(io.BytesIO(data), weights_only=True)
