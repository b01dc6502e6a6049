"""The files of a checkpoint: names, atomic writes, fsync, the ``latest`` pointer, finding a tag,
checked reads and the clean-up of what dead saves left behind. No collectives here."""
from __future__ import annotations

import hashlib
import os
import shutil
import warnings
import zlib
from typing import Any

import torch

from .errors import CORRUPTED, CheckpointError

METADATA = "metadata.json"
LATEST = "latest"
MODEL_FILE = "model.safetensors"  # rank 0's persistent buffers and parameters the optimizer does not train
TMP_PREFIX = ".tmp-"  # a save in progress (or one that died): never loaded
OLD_PREFIX = ".old-"  # a tag being overwritten, kept until its replacement is in place
#: the folder the framework integrations write their checkpoint into, inside the framework's own
#: (HF Trainer's checkpoint-N/, Accelerate's save_state folder, Lightning's); found by ``resolve``
FRAMEWORK_DIR = "fused_zero"
#: how the messages name the tag argument: ``tag=`` in Python, ``--tag`` on the command line
PASS_TAG = "pass the tag (tag= in Python, --tag on the command line)"


def rank_file(rank: int, world_size: int) -> str:
    return f"shards-rank{rank:05d}-of-{world_size:05d}.safetensors"


def check_tag(tag: Any) -> str:
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str (a directory name), got {type(tag).__name__}")
    if (not tag or tag in (".", "..", LATEST) or tag.startswith(".") or any(c in tag for c in "/\\\0")
            or tag.strip() != tag):
        raise ValueError(f"tag {tag!r} cannot name a checkpoint directory: use a plain name such as 'step100' "
                         f"(no path separators, no leading '.', not {LATEST!r})")
    return tag


def crc32(t: torch.Tensor) -> int:
    """crc32 of a CPU tensor's bytes (any dtype, bf16 included)."""
    flat = t.detach().contiguous().reshape(-1)
    return zlib.crc32(memoryview(flat.view(torch.uint8).numpy())) if flat.numel() else 0


def write_file(path: str, data: bytes) -> dict:
    """Write and fsync ``data``; its size and sha256 for the metadata."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # not every platform can fsync a directory
        pass


def set_latest(directory: str, tag: str) -> None:
    """Atomically point ``directory/latest`` at ``tag`` (write, fsync, rename)."""
    tmp = os.path.join(directory, LATEST + ".tmp")
    write_file(tmp, (tag + "\n").encode())
    os.replace(tmp, os.path.join(directory, LATEST))
    fsync_dir(directory)


def read_checked(path: str, meta: dict, name: str) -> bytes:
    """The bytes of ``path/name``, checked against the sha256 the metadata records."""
    file = os.path.join(path, name)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read ({e.strerror or e}): {CORRUPTED}") from None
    if hashlib.sha256(data).hexdigest() != meta["files"][name]["sha256"]:
        raise CheckpointError(f"{file} fails its sha256 check: {CORRUPTED}")
    return data


def _tags(directory: str) -> list[str]:
    entries = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return [e for e in entries if not e.startswith(".") and os.path.isfile(os.path.join(directory, e, METADATA))]


def _read_latest(directory: str) -> str:
    latest = os.path.join(directory, LATEST)
    if not os.path.isfile(latest):
        raise FileNotFoundError(f"no checkpoint in {directory}: it has no {LATEST!r} file (and no {FRAMEWORK_DIR}/ "
                                f"folder of a framework's checkpoint); check the path, or {PASS_TAG} to name one")
    with open(latest, "rb") as f:
        text = f.read().decode("utf-8", errors="replace").strip()
    try:
        return check_tag(text)
    except (TypeError, ValueError):
        raise CheckpointError(f"{latest} holds {text[:60]!r}, which is not a tag: the file is corrupted; "
                              f"{PASS_TAG} to load one of {_tags(directory)}, or write that tag into it") from None


def resolve(directory, tag: str | None) -> str:
    """The folder of checkpoint ``tag`` (default: the one ``latest`` names, or ``directory`` itself).

    ``directory`` may also be a framework's checkpoint folder (an HF Trainer ``checkpoint-N``, an
    Accelerate ``save_state`` folder) that holds the fused_zero checkpoint in ``FRAMEWORK_DIR``.
    """
    directory = os.fspath(directory)
    inner = os.path.join(directory, FRAMEWORK_DIR)
    if not os.path.isfile(os.path.join(directory, LATEST)) and not os.path.isfile(os.path.join(directory, METADATA)) \
            and os.path.isdir(inner):
        directory = inner
    from_latest = tag is None
    if from_latest:
        if os.path.isfile(os.path.join(directory, METADATA)):
            return directory
        tag = _read_latest(directory)
    path = os.path.join(directory, check_tag(tag))
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    entries = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    olds = [e for e in entries if e.startswith(f"{OLD_PREFIX}{tag}-") and os.path.isfile(os.path.join(directory, e,
                                                                                                     METADATA))]
    if olds:
        warnings.warn(f"{path} is missing (a save overwriting it died): loading its previous version {olds[-1]}")
        return os.path.join(directory, olds[-1])
    if from_latest:
        raise CheckpointError(f"{os.path.join(directory, LATEST)} names tag {tag!r}, but {path} does not exist (or "
                              f"has no {METADATA}): {PASS_TAG} to load one of {_tags(directory)}, or write that tag "
                              f"into {LATEST}")
    raise FileNotFoundError(f"checkpoint {path} does not exist (or has no {METADATA}); tags in {directory}: "
                            f"{_tags(directory)}")


def clean(directory: str) -> None:
    """Remove what saves that died left behind, and replaced tags (rank 0)."""
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if entry.startswith(TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif entry.startswith(OLD_PREFIX):
            tag = entry[len(OLD_PREFIX):].rsplit("-", 1)[0]
            if os.path.isfile(os.path.join(directory, tag, METADATA)):
                shutil.rmtree(path, ignore_errors=True)
