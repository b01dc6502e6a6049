"""Compile ``kernels/pack.py``'s kernel for sm_90 without a GPU (run by test_pack.py in a process
without TRITON_INTERPRET): every bucket dtype, pack / scaled accumulate / unpack, aligned or not,
every dtype branch present. Prints whether the aligned fp32 copy stores 128 bits at a time."""
from _sm90 import compile_sm90

from fused_zero.kernels import pack as kpack

wide = False
for bucket in ("*fp32", "*bf16", "*fp16"):
    sig = {"table_ptr": "*i64", "addr_ptr": "*i64", "bucket_ptr": bucket, "scale": "fp32"}
    for unpack, accumulate, has_scale in [(False, False, False), (False, True, True), (True, False, False)]:
        for aligned in (False, True):
            consts = dict(CODES=15, UNPACK=unpack, ACCUMULATE=accumulate, HAS_SCALE=has_scale, ALIGNED=aligned,
                          BLOCK=kpack.BLOCK)
            options = {"num_warps": kpack.NUM_WARPS, "enable_fp_fusion": not (has_scale and accumulate)}
            ptx = compile_sm90(kpack._pack_kernel, sig, consts, options).asm["ptx"]
            if aligned and bucket == "*fp32" and not (unpack or accumulate or has_scale):
                wide = "st.global.v4" in ptx
print("128-bit stores:", "yes" if wide else "no")
