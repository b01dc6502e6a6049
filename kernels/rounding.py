"""fp32 -> bf16 rounding on the bits, exact under the Triton interpreter too.

The interpreter truncates fp32 -> bf16 casts instead of rounding to nearest
even, so the kernels never use ``.to(tl.bfloat16)`` on values: they round on
the fp32 bits (add 0x7FFF plus the lowest kept bit, shift by 16) and bitcast.
NaN becomes 0xFFFF, the pattern torch's CPU conversion writes (any NaN is a
NaN to the tests; only finite and infinite values are compared bit by bit).
"""
import triton
import triton.language as tl


@triton.jit
def bf16_bits_rne(x):
    """uint16 bits of fp32 ``x`` rounded to nearest even bf16."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    rounded = tl.where(x != x, 0xFFFF, rounded)
    return rounded.to(tl.uint16)


@triton.jit
def to_bf16_rne(x):
    """fp32 ``x`` rounded to nearest even, as a bf16 tensor."""
    return bf16_bits_rne(x).to(tl.bfloat16, bitcast=True)


@triton.jit
def bf16_bits_stochastic(x, rand_bits):
    """uint16 bits of fp32 ``x`` rounded stochastically to bf16.

    ``rand_bits`` are uniform uint32 values; their low 16 bits are added
    below the kept mantissa, so a value rounds up with probability equal to
    its distance from the lower bf16 neighbour (in units of one bf16 ulp).
    Infinities pass through unchanged and NaN becomes 0xFFFF. A finite value
    above the largest finite bf16 may carry into infinity, as it can under
    round-to-nearest.
    """
    bits = x.to(tl.uint32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = tl.where(finite, (bits + (rand_bits & 0xFFFF)) >> 16, bits >> 16)
    rounded = tl.where(x != x, 0xFFFF, rounded)
    return rounded.to(tl.uint16)
