"""GathersBehind: stages 1-2's all-gather of the updated parameters overlapped with the next forward, the states in
the parameters' memory (``update_behind=True`` without offload, the optimizer given the model).

As Megatron's ``overlap_param_gather``: ``step()`` updates the shards where it always does (inside it, one kernel
per partition), then launches each updated bucket's all-gather asynchronously, in the order the next forward
uses the buckets, and returns; each module's forward waits for its own parameters' buckets only. DDP all-reduces
behind backward; ZeRO's stages 1-2 also all-gather the parameters after the update, and on a fast host that
gather, inside ``step()``, is what separates them from DDP.

It stands where ``UpdateBehind`` stands for ``BucketsBehind`` (behind_buckets.py: the placeholders, the forward
hooks and every wait between steps are the same): ``start`` launches instead of handing jobs to a worker, and
``wait(key)`` waits for that key's gathers on the calling thread (on a GPU, a GPU-side wait). Nothing runs on
another thread and nothing can fail midway: a collective's own error raises at the wait, as inside ``step()``.
"""
from __future__ import annotations

from .comm.collectives import Handle
from .sharding.partition import Partition
from .update import PartitionJob, UpdatePlan


class GathersBehind:
    """The all-gathers of the buckets a step updated, launched by ``step()`` and waited for by their modules."""

    gathers_only = True  # the update itself ran inside step(): there is no plan to hand over

    def __init__(self, landing) -> None:
        """``landing``: the BucketsBehind whose ``launch(key)`` starts a key's all-gathers."""
        self._landing = landing
        self._handles: dict[object, list[Handle]] = {}
        self._started = False

    @property
    def pending(self) -> bool:
        return self._started

    @property
    def failed(self) -> bool:
        return False  # a collective's error raises at its wait

    def start(self, partitions: list[Partition], plan: UpdatePlan | None,
              order: list[tuple[object, list[PartitionJob]]]) -> None:
        """Launch every key's all-gathers, in ``order`` (the next forward's); wait for none."""
        if self._started:
            raise RuntimeError("the all-gathers of the last step are still in flight: wait() for them first")
        self._started = True
        for key, _ in order:
            self._handles[key] = self._landing.launch(key)

    def wait(self, key=None) -> None:
        """Wait for ``key``'s gathers (None: every one, in launch order)."""
        if key is not None:
            for h in self._handles.pop(key, ()):
                h.wait()
            return
        try:
            for k in list(self._handles):
                for h in self._handles.pop(k):
                    h.wait()
        finally:
            self._handles.clear()
            self._started = False

    def close(self) -> None:
        self.wait()
