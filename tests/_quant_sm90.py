"""Compile ``kernels/quant.py``'s kernels for sm_90 without a GPU (run by test_quant.py in a process without
TRITON_INTERPRET): quantize for every input dtype, to nearest and stochastic, int8 and int4 (paired or not); dequantize
into every output dtype, each chunk and the sum of 8; aligned (what a large launch specializes) and not;
the smallest and largest block sizes. Prints what the PTX of the aligned fp32 launches shows: 128-bit
loads of the input (int4's paired and contiguous loads) and 128-bit stores of the output (the payload is read one
integer a thread, the values each thread stores), and no int/float conversion outside the stochastic hash."""
import re

from _sm90 import compile_sm90

from fused_zero.kernels import quant as kq

FLOATS = ("fp32", "bf16", "fp16")
OPTIONS = {"num_warps": kq.NUM_WARPS, "enable_fp_fusion": False}
CONVERT = re.compile(r"cvt\.[a-z.]*(f16|f32)\.[su](8|16|32|64)\b|cvt\.[a-z.]*[su](8|16|32|64)\.(f16|f32)\b")
WIDE_LOAD = re.compile(r"ld\.global[a-z0-9.]*\.(v4\.b32|v2\.b64)")  # 128 bits
ENCODE = ("n", "nb", "q_bytes", "chunk_words", "q_words")
DECODE = ("n", "nb", "chunk_words", "q_words", "magic")


def quantize(bits, x, stochastic, aligned, block=256, paired=False):
    sig = {"x_ptr": f"*{x}", "q_ptr": "*i8" if bits == 8 else "*u8", "s_ptr": "*fp32",
           **{k: "i32" for k in ENCODE}, "seed": "i32"}
    consts = dict(BITS=bits, BLOCK_Q=block, ROWS=kq._rows(block), STOCHASTIC=stochastic, PAIRED=paired)
    names = ("x_ptr", "q_ptr", "s_ptr") + ENCODE if aligned else ()
    return compile_sm90(kq._quantize_kernel, sig, consts, OPTIONS, names).asm["ptx"]


def dequantize(bits, out, chunks, aligned, block=256, wide=False):
    sig = {"q_ptr": "*i8" if bits == 8 else "*u8", "s_ptr": "*fp32", "out_ptr": f"*{out}",
           **{k: "i32" for k in DECODE}}
    consts = dict(BITS=bits, BLOCK_Q=block, ROWS=kq._rows(block), SUM=chunks > 1, CHUNKS=chunks, WIDE=wide)
    names = ("q_ptr", "s_ptr", "out_ptr") + DECODE if aligned else ()
    return compile_sm90(kq._dequantize_kernel, sig, consts, OPTIONS, names).asm["ptx"]


count, wide, exact = 0, True, True
for bits in (8, 4):
    for dtype in FLOATS:
        for aligned in (True, False):
            for stochastic, paired in [(False, False), (True, False)] + [(False, True), (True, True)] * (bits == 4):
                ptx = quantize(bits, dtype, stochastic, aligned, paired=paired)
                count += 1
                if aligned and dtype == "fp32":
                    wide &= bool(WIDE_LOAD.search(ptx))
                    exact &= stochastic or not CONVERT.search(ptx)
            for chunks in (1, 8):
                for pair in (False, True) if bits == 8 and dtype != "fp32" else (False,):
                    ptx = dequantize(bits, dtype, chunks, aligned, wide=pair)
                    count += 1
                    if aligned:
                        wide &= "st.global.v4" in ptx
                        exact &= dtype != "fp32" or not CONVERT.search(ptx)
    for block in (32, 8192):
        quantize(bits, "fp32", False, True, block, paired=bits == 4)
        dequantize(bits, "bf16", 2, True, block, wide=bits == 8)
        count += 2
print("compiled:", count)
print("128-bit loads and stores:", "yes" if wide else "no")
print("no int/float conversion:", "yes" if exact else "no")
