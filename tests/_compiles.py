"""Run a tests/_*_sm90.py script: it compiles kernels for sm_90 (H100 / H200) without a GPU, in a process
without TRITON_INTERPRET (the interpreter replaces the compiler's builders) and with a fresh Triton cache."""
import os
import subprocess
import sys


def run_sm90_script(name: str, cache_dir) -> str:
    """The stdout of tests/``name`` run so; an AssertionError with its stderr's tail if it failed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
