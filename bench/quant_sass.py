"""Instructions per element of the codec kernels on sm_90 (H100 / H200), counted without a GPU.

    python bench/quant_sass.py [OUT_DIR]      # run without TRITON_INTERPRET; OUT_DIR keeps .ptx/.sass

Compiles ``kernels/quant.py``'s kernels as a launch at bench_quant.py's sizes specializes them (every
pointer and size a multiple of 16; 2**23-element chunks, block 256, 8 chunks for the sum) with the
triton wheel's ptxas, disassembles them with its cuobjdump, and prints per kernel the static SASS
instruction count divided by the elements a thread handles (TILE / threads; for the sum, per output
element: 8 payloads decoded; a kernel that loops over the chunks at run time has its loop body counted
once), with the global loads and stores by width. Static counts include the
division's slow path, which a normal block never runs, so they bound the executed count from above.

The yardstick: at copy bandwidth an H200 moves ~16 bytes per SM clock (4.15 TB/s over 132 SMs at
~1.98 GHz) and issues at most 128 thread-instructions per SM clock, so a kernel stays memory-bound
only below ~128 / (16 / bytes per element) instructions per element: 40 for int8 from fp32 (5 bytes),
24 for int8 bf16 (3), 36 / 20 for int4 fp32 / bf16 (4.5 / 2.5); the sum of 8 per output element:
96 / 80 (int8 fp32 / bf16), 64 / 48 (int4). Integer ops run at half that rate and int/float
conversions at a quarter, so these are upper bounds.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fused_zero.kernels import quant as kq

TARGET = GPUTarget("cuda", 90, 32)
BLOCK = 256


def _compile(fn, pointers, consts):
    """``fn`` compiled with ``pointers`` (name: type), the constexprs it has of ``consts``, every other
    argument an int32, all but the seed specialized as multiples of 16 (a large aligned launch)."""
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {k: pointers.get(k, "constexpr" if k in consts else "i32") for k in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(fn.arg_names) if k not in consts and k != "seed"}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": kq.NUM_WARPS, "enable_fp_fusion": False})


def _sass(kernel, out_dir, name):
    cubin = os.path.join(out_dir, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    with open(os.path.join(out_dir, f"{name}.ptx"), "w") as f:
        f.write(kernel.asm["ptx"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out_dir, f"{name}.sass"), "w") as f:
        f.write(text)
    return re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", text, re.M)


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    per_thread = kq.TILE / (32 * kq.NUM_WARPS)
    print(f"sm_90, block {BLOCK}, TILE {kq.TILE}, {kq.NUM_WARPS} warps: {per_thread:.0f} elements per thread")
    for bits in (8, 4):
        q_ty = "*i8" if bits == 8 else "*u8"
        for dt in ("fp32", "bf16"):
            runs = []
            shape = dict(BITS=bits, BLOCK_Q=BLOCK, ROWS=kq._rows(BLOCK))
            for stochastic in (False, True):
                consts = dict(shape, STOCHASTIC=stochastic, PAIRED=bits == 4)
                pointers = {"x_ptr": f"*{dt}", "q_ptr": q_ty, "s_ptr": "*fp32"}
                runs.append((f"quantize int{bits} {dt} {'stochastic' if stochastic else 'nearest'}",
                             _compile(kq._quantize_kernel, pointers, consts)))
            for chunks in (1, 8):
                consts = dict(shape, SUM=chunks > 1, CHUNKS=chunks, HW_BF16=True,  # (taken where the kernel has it)
                              WIDE=bits == 8 and dt == "bf16")  # as a launch at these sizes sets it
                pointers = {"q_ptr": q_ty, "s_ptr": "*fp32", "out_ptr": f"*{dt}"}
                runs.append((f"dequantize int{bits} {dt} {'sum8' if chunks > 1 else 'each'}",
                             _compile(kq._dequantize_kernel, pointers, consts)))
            for name, kernel in runs:
                ops = _sass(kernel, out_dir, name.replace(" ", "_"))
                memory = collections.Counter(o for o in ops if o.startswith(("LDG", "STG")))
                print(f"  {name:36s} {len(ops):5d} SASS  {len(ops) / per_thread:6.2f} per element   "
                      + " ".join(f"{k} {v}" for k, v in sorted(memory.items())))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1 (the interpreter replaces the compiler)")
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="quant_sass_"))
