"""The tensor files of a checkpoint: this rank's chunks out (save), checked chunks, buffers and
blobs in (load, consolidate). Every read failure is a CheckpointError naming the file."""
from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

from .codec import from_blob
from .errors import CORRUPTED, CheckpointError
from .files import MODEL_FILE, crc32, read_checked
from .reshard import Chunk, aliases, chunks, numel_of
from .view import ModelView


def tensor_key(name: str, kind: str, start: int) -> str:
    """Key of one saved chunk: elements [start, start + numel) of parameter ``name``'s ``kind``."""
    return f"{name}:{kind}:{start}"


def shard_tensors(view: ModelView, chunk_numel: int) -> tuple[dict[str, torch.Tensor], list[list]]:
    """This rank's chunks as ({key: CPU tensor}, [[name, start, numel, crc per kind...], ...])."""
    tensors, table = {}, []
    for k, part in enumerate(view.index):
        for piece in part.pieces:
            name = view.name(part.params[piece.param_index])
            for start, n in chunks(piece.param_offset, piece.numel, chunk_numel):
                lo = piece.shard_offset + start - piece.param_offset
                row = [name, start, n]
                for kind in part.kinds:
                    t = view.opt.read_shard(k, kind, lo, lo + n)
                    tensors[tensor_key(name, kind, start)] = t
                    row.append(crc32(t))
                table.append(row)
    return tensors, table


def unblob(path: str, meta: dict, name: str | None) -> Any:
    """A saved scheduler state or extra (None when none was saved)."""
    if name is None:
        return None
    data = read_checked(path, meta, name)
    try:
        return from_blob(name, data)
    except Exception as e:  # noqa: BLE001 - json, pickle and zip errors, made to name the file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{os.path.join(path, name)} cannot be decoded ({why}): {CORRUPTED}") from None


def _tensors_of(file: str) -> dict[str, torch.Tensor]:
    """What safetensors can still read of a damaged file (nothing when its header is damaged)."""
    try:
        with open(file, "rb") as f:
            return safetensors.torch.load(f.read())
    except Exception:  # noqa: BLE001
        return {}


def model_tensors(path: str, meta: dict) -> dict[str, torch.Tensor]:
    """model.safetensors; a corrupted file names the buffers and parameters that differ."""
    file = os.path.join(path, MODEL_FILE)
    try:
        data = read_checked(path, meta, MODEL_FILE)
    except CheckpointError:
        tensors = _tensors_of(file)
        bad = [k for k, info in meta["model_tensors"].items() if k not in tensors or crc32(tensors[k]) != info["crc32"]]
        raise CheckpointError(f"{file} fails its sha256 check (tensors that differ: {bad or 'none; its header'}): "
                              f"{CORRUPTED}") from None
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # noqa: BLE001 - the sha256 matched a file safetensors cannot read
        raise CheckpointError(f"{file} cannot be read ({str(e).splitlines()[0]}): {CORRUPTED}") from None


class Reader:
    """Reads saved chunks from the rank files, checking each one's crc32."""

    def __init__(self, path: str, meta: dict, stack: ExitStack) -> None:
        self.path, self.meta, self.stack, self.files = path, meta, stack, {}

    def chunk(self, name: str, c: Chunk) -> dict[str, torch.Tensor]:
        """The chunk's tensors by kind."""
        fname = self.meta["rank_files"][c.file]
        file = os.path.join(self.path, fname)
        try:
            if fname not in self.files:
                self.files[fname] = self.stack.enter_context(safe_open(file, framework="pt"))
            out = {}
            for kind, crc in zip(self.meta["params"][name]["kinds"], c.crcs):
                key = tensor_key(name, kind, c.start)
                t = self.files[fname].get_tensor(key)
                if t.numel() != c.numel or t.dtype != torch.float32 or crc32(t) != crc:
                    raise CheckpointError(f"{file}: tensor {key!r} (parameter {name!r}, {kind}, elements "
                                          f"{c.start}..{c.start + c.numel}) fails its crc32 check: {CORRUPTED}")
                out[kind] = t
            return out
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors, made to name the file
            raise CheckpointError(f"{file} cannot be read ({str(e).splitlines()[0]}) for parameter {name!r}: "
                                  f"{CORRUPTED}") from None

    def full(self, name: str, kinds: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Every saved kind of parameter ``name`` (or those of ``kinds``), full-shape."""
        rec = self.meta["params"][name]
        out = {kind: torch.zeros(numel_of(rec["shape"]), dtype=torch.float32) for kind in rec["kinds"]
               if kinds is None or kind in kinds}
        for row in rec["chunks"]:
            c = Chunk.parse(row)
            for kind, src in self.chunk(name, c).items():
                if kind in out:
                    out[kind][c.start:c.start + c.numel] = src
        return {kind: t.view(rec["shape"]) for kind, t in out.items()}


def model_state(path: str, meta: dict) -> dict:
    """The model's state_dict of the checkpoint at ``path`` (fp32 parameters from the masters, buffers as saved), as
    ``consolidate`` gives it, reading the masters only (a weights-only load: ``load(directory, model, None)``)."""
    return full_tensors(path, meta, kinds=("master",))[0]


def full_tensors(path: str, meta: dict, kinds) -> tuple[dict, dict]:
    """(the model's state_dict, {parameter name: {kind: full tensor}} of ``kinds``, all when None), every chunk and
    file checked."""
    saved = model_tensors(path, meta)
    full = {}
    with ExitStack() as stack:
        reader = Reader(path, meta, stack)
        for name, rec in meta["params"].items():
            trained = rec["group"] is not None and rec["kinds"]  # (no kinds: frozen when saved, a model tensor)
            full[name] = reader.full(name, kinds) if trained else {"master": saved[name].float()}
    for fname in meta["rank_files"]:
        read_checked(path, meta, fname)
    alias = aliases(meta)
    return {k: full[alias[k]]["master"] if k in alias else saved[k] for k in meta["state_dict_keys"]}, full
