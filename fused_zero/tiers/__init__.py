"""Memory tiers: where a partition's optimizer states and narrow param shard live.

- ``tier.py``: ``Tier`` (DEVICE, HOST, NVME), the one vocabulary of the tiers.
- ``factory.py``: ``Tiers``, the one tier decision: a partition's state store and narrow param
  shard together (a frozen partition's: ``WeightsOnly`` and the params tier's shard).
- ``store.py``: the ``ShardStore`` interface, ``DeviceStore`` (beside the parameters) and
  ``WeightsOnly`` (frozen parameters: no state).
- ``store_host.py``: ``HostStore`` (``offload_optimizer="cpu"``), the update on the host.
- ``store_nvme.py``: ``NvmeStore`` (``offload_optimizer="nvme"``), the states in a scratch file.
- ``param_store.py``: the narrow param shard's owners, one ``ParamShard`` per tier.
- ``staging.py``: the host staging buffers an optimizer's offloaded stores share.
- ``transfer.py``: host buffers and the copies between host and device.
- ``scratch.py``: ``ScratchFile``, the one private NVMe file (NvmeStore's and NvmeParamShard's).

A new offload tier is one ``Tier`` member, one ``ShardStore`` (and, for stage 3's parameters, one
``ParamShard``) here, and its branch in ``factory.py``.
"""
