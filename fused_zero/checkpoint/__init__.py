"""Checkpoints of ShardedOptimizer that load at any world size and stage, and consolidate.

    tag = save(directory, model, optimizer, scheduler=None, *, tag=None, extra=None)  # every rank
    extra = load(directory, model, optimizer, scheduler=None, *, tag=None)             # every rank
    extra = load(directory, model, None)     # the model's weights only (a new optimizer), any process
    model_sd, optim_sd = consolidate(directory, tag=None)     # one process: plain PyTorch
    load_torch_state(model, optimizer, optim_sd, model_state_dict=None)  # a torch.optim.AdamW state in
    python -m fused_zero.checkpoint consolidate DIR OUT [--tag TAG]

On disk (``DIR`` on a filesystem every rank sees)::

    DIR/latest               the tag of the newest complete checkpoint (one line)
    DIR/<tag>/metadata.json  written last: every parameter by its name in model.named_parameters()
                             (aliases, shape, dtype, param group, step count, and the saved chunks
                             that hold its elements, with their crc32), the param groups'
                             hyperparameters and members, the state-dict key order, and every
                             file's size and sha256; sealed by a sha256 of its own canonical JSON
    DIR/<tag>/shards-rank<r>-of-<n>.safetensors  rank r's fp32 master, exp_avg and exp_avg_sq (and
                             max_exp_avg_sq with amsgrad): a 1-D tensor "<name>:<kind>:<first element>"
                             per run of at most chunk_numel elements of a parameter in that rank's shard
    DIR/<tag>/model.safetensors  rank 0's persistent buffers (by state-dict key) and any parameter
                             the optimizer does not train
    DIR/<tag>/scheduler.json, extra.json  the LR scheduler's state_dict and ``extra``: JSON, or
                             scheduler.pt / extra.pt (torch.save, loadable with weights_only=True)

Nothing needs unpickling code to load. Every malformed or corrupted file (metadata.json edited,
not JSON or missing fields; a truncated, missing or garbage tensor file; a corrupted blob; a
``latest`` naming nothing) raises CheckpointError naming the file, on every rank. A format-1
metadata.json (before checksums) still loads, with a warning to save it again.

Crash safety: every rank writes and fsyncs its files in ``DIR/.tmp-<tag>-<id>/``; when all have
succeeded rank 0 writes metadata.json there, renames the folder to ``DIR/<tag>`` and then atomically
replaces ``DIR/latest`` (write, fsync, rename). A save that dies at any point leaves ``latest``
naming the previous complete checkpoint; load ignores ``.tmp-*`` folders and the next save removes
them. Overwriting a tag first moves the old folder to ``.old-<tag>-<id>``, which load falls back to
if the save died before the new one took its place.

Load checks that the model has exactly the saved parameters and buffers (names, shapes) and the
optimizer the saved param groups; each rank then reads only the chunks that overlap its shard
pieces (safe_open per tensor), checks each one's crc32 and reshards them into its partitions.
Small files are checked against their sha256; consolidate checks every chunk and every file.
Every phase ends in one all_gather_object that carries any rank's error to all ranks, which all
raise it, so none is left waiting; the optimizer changes only after every rank has read all it
needs. load_torch_state is the reverse of consolidate: torch.optim.AdamW's state_dict in.

ShardedOptimizer.state_dict() / load_state_dict() (optim_state.py) are torch.optim.AdamW's own
format, gathered and sliced collectively, for frameworks that save the optimizer's state_dict.

Modules, one job each: files (names, atomic writes, ``latest``, clean-up), metadata (build, seal,
check, fit to a model), reshard (chunk and range math), shards (tensor files in and out), codec
(JSON of hyperparameters and schedulers), view (the model and optimizer by name), save_load,
torch_format (AdamW state_dict <-> shards, consolidate, load_torch_state), optim_state, __main__.
"""
from .errors import CheckpointError
from .save_load import load, read_extras, save
from .torch_format import consolidate, load_torch_state

__all__ = ["save", "load", "consolidate", "load_torch_state", "read_extras", "CheckpointError", "main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m fused_zero.checkpoint ...`` (see __main__.py)."""
    from .__main__ import main as cli

    return cli(argv)
