"""``capturable=True``: step()'s device work captured once as a CUDA graph and replayed, as Megatron's optimizer graph.

A step splits in three (optimizer.py): the host half before (checks, the gradient reductions' waits, the
hyperparameters read, the stats vector built and sent), the device body (the stats all-reduce, the clip and
GradScaler factors, the step counts' advance, the fused AdamW update of every partition, the all-gather of
the updated buckets) and the host half after (the verdict posted, the scaler told, the traffic counted).
Only the body is captured. It is a function of tensors that stay where they are between steps (the flat
buffers, the gradient shards, the states, the step counts) and of this module's static inputs, which the
host half refills before each replay without waiting for the device: the stats vector, the GradScaler's
inverse scale and ``found_inf``, each group's lr (so a schedule is followed; the other hyperparameters are
in the key).

The body's host decisions (which parameters got a gradient, which step counts are equal, which options and
hyperparameters apply, whether a clip or a scaler came) make the step's ``key`` (``StepGraph.key``).
``StepGraph.run`` runs a key's first ``WARMUP`` steps eagerly, then captures its body and replays it whenever
the key comes again (the last ``MAX_GRAPHS`` keys keep their graphs). After one ``clip_grad_norm_`` (its
all-reduce ran before step()) the body reads the clip's norm and verdicts from static copies. A step with no
key runs eagerly: a first step creating states, a step after two clips or after one made before the scaler
was known, a rank among several that saw no gradient for some parameter (it must read whether another rank
did), a refused step. A capture that fails is warned about once and its key runs eagerly. A replay does what
the eager body does, bit for bit (tests/test_step_graph.py checks it on CPU with ``tests/_graph_twin.py``, a
replay of the recorded ops that stands in for the CUDA graph there).
"""
from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple

import torch

from .amp import PendingClip, ScalerInputs
from .config import STAGE_TRAITS
from .stats import per_partition
from .update import REFUSED

#: eager steps with one key before that key's body is captured (the kernels compiled, NCCL's communicators
#: made, the allocator warm)
WARMUP = 2
#: graphs kept, one per key, the least recently replayed dropped first (keys that take turns: a step that
#: clips and one that does not)
MAX_GRAPHS = 4

#: what makes a graph: ``new_graph()`` returns an object with ``capture()`` (a context manager: the body runs
#: once inside it, recorded, not executed on the device) and ``replay()``. CUDA graphs; the tests swap in
#: ``tests/_graph_twin.py`` on CPU, and set ``on_cpu``
new_graph: Callable[[], Any] | None = None
on_cpu = False


class _CudaGraph:
    """torch.cuda.CUDAGraph with the capture as a context manager (torch.cuda.graph: its own stream and pool)."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    @contextmanager
    def capture(self):
        # thread_local: a process group's watchdog thread may query events meanwhile (NCCL), which "global" refuses
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            yield

    def replay(self) -> None:
        self.graph.replay()


def refusal(capturable: bool, config, device: torch.device | None, host_checked: bool = False) -> str | None:
    """Why ``capturable=True`` cannot be served with these options (None: it can, or it is off). ``host_checked``:
    among ranks, torch checks every collective on the host first (TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    if not capturable:
        return None
    if host_checked:
        return ("capturable=True cannot run under TORCH_DISTRIBUTED_DEBUG=DETAIL among ranks: torch then checks "
                "every collective with a host exchange first, which a replayed graph skips while a rank stepping "
                "eagerly makes it; unset TORCH_DISTRIBUTED_DEBUG (or set it to INFO), or use capturable=False")
    if device is not None and device.type != "cuda" and not on_cpu:
        return (f"capturable=True replays step() as a CUDA graph and needs the parameters on a CUDA device (they "
                f"are on {device.type}), as torch's capturable optimizers do; use capturable=False (the step "
                "reads nothing on the host either way)")
    if STAGE_TRAITS[config.stage].shards_params:
        return ("capturable=True serves stages 1 and 2: stage 3's step releases every unit's gathered parameters "
                "on the host; use stage=2, or capturable=False")
    for option in ("offload_optimizer", "offload_params"):
        if getattr(config, option) is not None:
            return (f"capturable=True cannot serve {option}={getattr(config, option)!r}: the update runs on the "
                    "host, outside any CUDA graph; use capturable=False")
    if config.update_behind:
        return ("capturable=True cannot serve update_behind=True (the all-gathers, and an offloaded update, run "
                "behind step() on the host's schedule, outside any CUDA graph); drop one")
    return None


def check_not_capturing() -> None:
    """A step() inside the user's own CUDA graph capture: refused (its host bookkeeping would not replay). Called
    only for parameters on CUDA, once a step."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("ShardedOptimizer.step() cannot be captured in your own CUDA graph: it keeps host "
                           "bookkeeping every step that a replay would skip. Build it with capturable=True: it "
                           "captures its own step's device work after warm-up steps and replays it, with the "
                           "host bookkeeping around each replay")


class _Captured(NamedTuple):
    """One key's graph, what its body returned (tensors the graph writes at every replay), and the bytes its
    collectives counted at capture, per communicator (counted again at every replay)."""

    graph: Any
    result: Any
    traffic: list


class StepGraph:
    """The captured bodies of step(), one per key (the last ``MAX_GRAPHS`` keys), and their static inputs."""

    def __init__(self, traffic_comms: Callable[[], list]) -> None:
        self._traffic_comms = traffic_comms  # the communicators the body's collectives count on
        self._graphs: OrderedDict = OrderedDict()  # key -> _Captured, the most recently used last
        self._seen: dict = {}  # key -> eager steps run with it (captured after WARMUP)
        self._failed: set = set()  # keys whose capture raised: run eagerly
        self._static: dict = {}
        self._missing_streak = 0  # among ranks: steps in a row this rank missed a gradient (no key)
        self.captures = 0  # graphs captured so far
        self.replays = 0

    # -- static inputs: refilled before every step (eager ones too, so both read the same values) ---------------
    def static(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` copied into the static tensor ``name`` (made on first use, like ``value``); no host wait."""
        t = self._static.get(name)
        if t is None or t.shape != value.shape or t.dtype != value.dtype or t.device != value.device:
            t = self._static[name] = torch.empty_like(value)
            self._graphs.clear()  # a new static tensor: a graph reading the old one is stale
        t.copy_(value, non_blocking=True)
        return t

    def lr(self, name, value: float, device: torch.device) -> torch.Tensor:
        """Group ``name``'s lr as a 0-d float64 tensor on ``device`` (a Python number would be baked into a graph;
        float64, as the kernels take a number lr, so the step is the one ``capturable=False`` takes)."""
        t = self._static.get(name)
        if t is None:
            t = self._static[name] = torch.zeros((), dtype=torch.float64, device=device)
        t.fill_(value)
        return t

    def hypers(self, hypers, partitions: list):
        """Each partition's hyperparameters with its group's lr (read as a number, update.read_hypers) in a static
        device tensor (``REFUSED`` as it is)."""
        if hypers is REFUSED:
            return hypers
        device = partitions[0].grad_shard.device if partitions else None
        return [h._replace(values={**h.values, "lr": self.lr(("lr", part.group_index), h.values["lr"], device)})
                for h, part in zip(hypers, partitions)]

    def scaler(self, scaler: ScalerInputs) -> ScalerInputs:
        """The GradScaler's inverse scale and ``found_inf`` (fresh tensors every step) in static tensors."""
        return scaler._replace(**{name: self.static(name, t) for name, t in
                                  (("inv_scale", scaler.inv_scale), ("found_inf", scaler.found_inf))
                                  if isinstance(t, torch.Tensor)})

    @staticmethod
    def clip_serves(clip: PendingClip, scaler: ScalerInputs) -> bool:
        """Whether a step after ``clip_grad_norm_`` can replay: the clip's norm is final (no scaler turned up only
        at step(), which writes the unscaled norm into the tensor the user holds) and it is the step's only clip
        (a second one chains factors on the host)."""
        return clip.previous is None and not clip.unscales_at_step(scaler)

    def clip(self, clip: PendingClip) -> PendingClip:
        """``clip`` with its device values (its all-reduce's norm, verdicts and returned norm: fresh tensors every
        step) in static tensors."""
        stats = clip.stats
        stats = stats._replace(sq_norm=self.static("clip_sq_norm", stats.sq_norm),
                               nonfinite=self.static("clip_nonfinite", stats.nonfinite),
                               disagree=None if stats.disagree is None else self.static("clip_disagree", stats.disagree))
        return clip._replace(stats=stats, total=self.static("clip_total", clip.total))

    # -- the key: every host decision the body makes ----------------------------------------------------------
    def key(self, partitions: list, state: dict, with_norm: bool, scaler: ScalerInputs, hypers,
            flags: tuple[bool, ...], alone: bool, names: dict, clip: PendingClip | None = None) -> tuple | None:
        """Every host decision the step's body makes, or None where one must be made afresh (a count or a state
        that user code set, a new state, which parameters got a gradient on another rank): equal keys, equal
        device work. ``flags``: this rank's has-grad flags (``alone``: they are the answer; among ranks a missing
        one must be asked of the others, a read). After ``clip_grad_norm_`` (``clip``, which ``clip_serves``) its
        all-reduce has already told every rank which parameters got a gradient anywhere: those are the flags."""
        every = all(flags) if clip is None else all(map(all, clip.stats.has_grad))
        if not every and not alone and clip is None:
            self._missing(partitions, flags, names)
            return None
        self._missing_streak = 0
        has_grad = clip.stats.has_grad if clip is not None else per_partition(flags, partitions)
        counts = []
        for part, mine in zip(partitions, has_grad):
            steady = None if part.step_counts is None else part.step_counts.steady(state, part, mine)
            if steady is None:
                return None
            counts.append(steady)

        def value(v):  # a tensor (the static lr) by where it lives: a graph reads it there
            return ("tensor", v.data_ptr(), v.dtype) if isinstance(v, torch.Tensor) else v
        return (with_norm, tuple(t is None for t in scaler[:2]), scaler.state is None, None if every else has_grad,
                None if clip is None else ("clip", clip.max_norm, clip.stats.disagree is None, clip.applied),
                tuple((tuple((k, value(v)) for k, v in h.values.items()), h.amsgrad) for h in hypers), tuple(counts))

    def _missing(self, partitions: list, flags: tuple[bool, ...], names: dict) -> None:
        """Among ranks: warn once when this rank misses gradients ten steps in a row (those steps run eagerly),
        naming the parameters."""
        self._missing_streak += 1
        if self._missing_streak != 10:
            return
        params = [p for part in partitions for p in part.params]
        missing = [names.get(p, f"of shape {tuple(p.shape)}") for p, f in zip(params, flags) if not f]
        warnings.warn(f"capturable=True: 10 steps in a row ran eagerly, not as the captured CUDA graph, because "
                      f"this rank saw no gradient for {len(missing)} parameters ({', '.join(map(str, missing[:5]))}"
                      f"{', ...' if len(missing) > 5 else ''}), so each step reads whether another rank saw one. "
                      "Freeze parameters the model never uses (requires_grad=False) before building the optimizer",
                      UserWarning, stacklevel=5)

    # -- the body --------------------------------------------------------------------------------------------
    def run(self, key, body: Callable[[], Any]):
        """``body()``'s result: run eagerly (the key's first ``WARMUP`` steps), or captured and replayed."""
        captured = self._graphs.get(key)
        if captured is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if seen <= WARMUP or key in self._failed:
                return body()
            captured = self._capture(key, body)
            if captured is None:
                return body()
        self._graphs.move_to_end(key)
        captured.graph.replay()  # (right after a capture too: a capture runs nothing)
        for comm, counted in zip(self._traffic_comms(), captured.traffic):
            comm.add_traffic(counted)
        self.replays += 1
        return captured.result

    def _capture(self, key, body: Callable[[], Any]) -> _Captured | None:
        """Record ``body`` as ``key``'s graph (None where the capture raised: warned once, the key runs eagerly)."""
        comms = self._traffic_comms()
        before = [comm.traffic() for comm in comms]
        # no garbage collection while capturing: a finalizer it runs (an earlier optimizer's pinned buffer or event
        # freed, a query of its event) would be a CUDA call on the capturing thread, which invalidates the capture
        # (seen once on an H100 after the other CUDA tests: "operation not permitted when stream is capturing").
        # torch.cuda.graph collects before the capture begins.
        collecting = gc.isenabled()
        gc.disable()
        try:
            graph = (new_graph or _CudaGraph)()
            with graph.capture():
                result = body()
        except Exception as error:  # (nothing ran on the device: the step runs eagerly instead)
            self._failed.add(key)
            warnings.warn(f"capturable=True: capturing step() as a CUDA graph failed ({type(error).__name__}: "
                          f"{error}); steps with these settings run eagerly", RuntimeWarning, stacklevel=4)
            captured = None
        else:
            counted = [{k: v - b.get(k, 0) for k, v in comm.traffic().items()} for comm, b in zip(comms, before)]
            captured = self._graphs[key] = _Captured(graph, result, counted)
            self.captures += 1
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        finally:
            if collecting:
                gc.enable()
        for comm, b in zip(comms, before):  # a capture moves nothing: the replays count
            comm.reset_traffic()
            comm.add_traffic(b)
        if len(self._seen) > 64:  # keys that never came back (a hyperparameter changed every step)
            self._seen = {k: n for k, n in self._seen.items() if k in self._graphs}
        return captured

    def close(self) -> None:
        """Forget the graphs, the keys and the static inputs (a rebuild: the partitions are new)."""
        self._graphs.clear()
        self._seen.clear()
        self._failed.clear()
        self._static.clear()
