"""Communication: everything that talks to other ranks.

- ``collectives.py``: ``Comm``, the only code that imports ``torch.distributed``; async handles,
  a world-size-1 path, and the bytes each collective moved. A new topology (a replicate group for
  HSDP, a node-local group) is one more ``Comm``.
- ``rendezvous.py``: the collective calls made outside a step meet every rank first.
- ``grad_sync.py``: pack each bucket's gradients and reduce-scatter them into the rank's shard
  (the gradient codec point).
- ``param_sync.py``: all-gather each bucket's shards back into the full flat buffer.
- ``gatherer.py``: stage 3's ``ParamGatherer``, the module hooks that gather each unit just in
  time, prefetch along the recorded order and release it after use.
"""
