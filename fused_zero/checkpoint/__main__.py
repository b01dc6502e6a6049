"""The command line: python -m fused_zero.checkpoint consolidate DIR OUT [--tag TAG]."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .errors import CheckpointError
from .save_load import read_extras
from .torch_format import consolidate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fused_zero.checkpoint", description="fused_zero checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a checkpoint's full fp32 model state_dict and torch.optim.AdamW "
                       "state_dict to OUT with torch.save: {'model': ..., 'optimizer': ..., 'scheduler': state_dict "
                       "or None, 'extra': ... or None}; read it with torch.load(OUT, weights_only=True)")
    c.add_argument("directory", help="the checkpoint directory (holding 'latest'), or one tag's folder")
    c.add_argument("out", help="the file to write")
    c.add_argument("--tag", default=None, help="the tag to consolidate (default: the one 'latest' names)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        print(f"error: no checkpoint at {args.directory!r}, which is not a folder: pass the checkpoint directory "
              "(the one holding 'latest', or one tag's folder)", file=sys.stderr)
        return 1
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(out_dir):
        print(f"error: OUT {args.out!r} must be a file path in an existing folder"
              + (" (it is a folder)" if os.path.isdir(args.out) else f" ({out_dir!r} does not exist)"), file=sys.stderr)
        return 1
    try:
        model_sd, optim_sd = consolidate(args.directory, args.tag)
        extras = read_extras(args.directory, args.tag)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tmp = args.out + ".tmp"
    try:
        torch.save({"model": model_sd, "optimizer": optim_sd, **extras}, tmp)
        os.replace(tmp, args.out)
    except (OSError, RuntimeError) as e:  # a full disk, a folder that went away: nothing half-written is left
        if os.path.isfile(tmp):
            os.remove(tmp)
        print(f"error: writing {args.out!r} failed: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {len(model_sd)} model tensors ({sum(t.numel() for t in model_sd.values())} elements), "
          f"AdamW state of {len(optim_sd['state'])} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
