"""A CPU twin of a CUDA graph, for the tests of ``capturable=True`` (fused_zero/step_graph.py).

``capture()`` runs the body once under a dispatch mode that records every aten op and c10d collective with
its arguments (a collective is not run: at capture NCCL only records it too, and a peer may be replaying
meanwhile), then puts back every tensor the ops wrote: as a CUDA capture, it leaves the device as it found
it (the version counters it bumped stay bumped, as a capture's in-place ops bump them). ``replay()`` runs the recorded ops again on the same tensors with
the same numbers, no Python of the body: what a CUDA graph replays. An op whose result was a new tensor at
capture writes its new result into that tensor (a graph's output keeps its address), so later ops and whoever
kept the tensor see the new values; version counters stay as they were (a replay runs no host code). What a CUDA capture refuses, the twin refuses: a read of a device value
on the host (``.item()``), and host data put into a tensor inside the capture (``torch.tensor([...])``:
a copy from a host buffer that the replay would read again, stale).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
_HOST_READS = {aten._local_scalar_dense.default, aten.item.default}
_HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes (its schema's ``(a!)`` arguments)."""
    out = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += _tensors(value)
    return out


def _done(func, args):
    """What a collective returns, without running it: its tensors (it writes its arguments) and finished work."""
    future = torch.futures.Future()
    future.set_result(None)
    work = torch._C._distributed_c10d._create_work_from_future(future).boxed()  # as the dispatcher hands it
    return (args[0], work) if len(func._schema.returns) == 2 else work


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []
        self.saved: dict = {}  # storage pointer -> (storage, its bytes before the capture)

    def _keep(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.saved and storage.nbytes():
            self.saved[storage.data_ptr()] = (storage, storage.clone())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(f"graph twin: {func} reads a device value on the host inside the capture "
                               "(a CUDA capture fails there)")
        if func in _HOST_DATA:
            raise RuntimeError(f"graph twin: {func} puts host data into a tensor inside the capture (the replay "
                               "would copy from that host buffer again)")
        if func.namespace == "c10d":  # a collective: recorded, not run (its peers may be replaying, not capturing)
            out = _done(func, args)
            self.ops.append((func, args, kwargs, None))
            return out
        for t in _written(func, args, kwargs):
            self._keep(t)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def restore(self) -> None:
        for storage, before in self.saved.values():
            storage.copy_(before)


class GraphTwin:
    """``capture()`` / ``replay()`` as step_graph.new_graph expects."""

    def __init__(self) -> None:
        self.ops = None
        self.replays = 0

    @contextmanager
    def capture(self):
        recorder = _Recorder()
        try:
            with recorder:
                yield
        finally:
            recorder.restore()  # a capture that raised ran nothing either
        self.ops = recorder.ops

    def replay(self) -> None:
        if self.ops is None:
            raise RuntimeError("graph twin: replay() before capture()")
        versions = {}
        for func, args, kwargs, out in self.ops:
            for t in _tensors((args, kwargs, out)):
                base = t if t._base is None else t._base  # views share their base's version counter
                versions.setdefault(id(base), (base, base._version))
            new = func(*args, **kwargs)
            if out is None:  # a collective: it wrote its arguments; wait for it here, as the body did
                for fresh in tree_flatten(new)[0]:
                    if hasattr(fresh, "wait") and not isinstance(fresh, torch.Tensor):
                        fresh.wait()
                continue
            for old, fresh in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(old, torch.Tensor) and fresh is not old and (
                        fresh.data_ptr() != old.data_ptr() or fresh.stride() != old.stride()):
                    old.copy_(fresh)
        tensors = [t for t, _ in versions.values()]
        torch._C._autograd._unsafe_set_version_counter(tensors, [v for _, v in versions.values()])
        self.replays += 1
