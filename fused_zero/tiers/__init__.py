"""Memory tiers: where a partition's optimizer states and narrow param shard live.

- ``store.py``: the ``ShardStore`` interface and ``DeviceStore`` (beside the parameters).
- ``store_host.py``: ``HostStore`` (``offload_optimizer="cpu"``), the update on the host.
- ``store_nvme.py``: ``NvmeStore`` (``offload_optimizer="nvme"``), the states in a scratch file.
- ``param_store.py``: the narrow param shard's owners, one ``ParamShard`` per tier.
- ``staging.py``: the host staging buffers an optimizer's offloaded stores share.
- ``transfer.py``: host buffers and the copies between host and device.

A new offload tier is one ``ShardStore`` (and, for stage 3's parameters, one ``ParamShard``) here.
"""
