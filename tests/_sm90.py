"""Compile a Triton kernel for sm_90 (an H100 / H200) without a GPU: frontend, LLVM and ptxas from the
triton wheel. For scripts run by the tests in a process without TRITON_INTERPRET (the interpreter replaces
the compiler's builders) and a fresh TRITON_CACHE_DIR: the interpreter accepts kernels that the compiler
refuses. ``aligned`` names the arguments a launch would specialize as multiples of 16 (pointers at 16-byte
aligned addresses, ints divisible by 16), as Triton does at run time: the code a large aligned launch gets.
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, signature: dict, constexprs: dict, options: dict, aligned=()):
    """The compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``) of ``fn`` for sm_90."""
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn=fn, signature=dict(signature, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                    attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)
