"""Communication: everything that talks to other ranks.

- ``collectives.py``: ``Comm``, the only code that imports ``torch.distributed``; async handles,
  a world-size-1 path, and the bytes each collective moved. A new topology (a replicate group for
  HSDP, a node-local group) is one more ``Comm``. Its parts that call no torch.distributed:
  ``tensor_checks.py`` (what a collective's tensors must be), ``traffic.py`` (the bytes counted),
  ``agreement.py`` (``agree``, ``check_same``: one verdict on every rank, through ``all_gather_object``),
  ``pins.py`` (the pinned aliases every tensor travels as).
- ``rendezvous.py``: the collective calls made outside a step meet every rank first.
- ``grad_buckets.py``: a bucket's paired ``start()`` (pack, the gradient codec point, and launch the
  reduce-scatter) and ``finish()`` (land it), and the pool and host landing every bucket shares.
- ``grad_sync.py``: the reducers, ``ReduceInBackward`` (stage 2; ``ReduceAmongGathers`` its stage-3 form) and
  ``ReduceAtStep`` (stage 1).
- ``param_sync.py``: all-gather each bucket's shards back into the full flat buffer.
- ``gatherer.py``: stage 3's ``ParamGatherer``, the module hooks that gather each unit just in
  time, prefetch along the recorded order and release it after use; ``gather_cycle.py`` how a unit
  is gathered and released and the schedule walked; ``model_state.py`` its hooks on
  ``model.state_dict()``/``load_state_dict()``; ``secondary.py`` hpZ's node-local copies for backward.
- ``topology.py``: which group each collective uses (``process_group=``, ``mesh=``, HSDP, hpZ's nodes).
"""
