"""Frameworks stay optional: importing fused_zero imports none; a missing one names its extra."""
import subprocess
import sys

import pytest

FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_fused_zero_imports_no_framework():
    r = _python("import sys, fused_zero, fused_zero.integrations, fused_zero.checkpoint, fused_zero.plan\n"
                f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("module,blocked,extra", [
    ("fused_zero.integrations.transformers", "transformers", "hf"),
    ("fused_zero.integrations.accelerate", "accelerate", "hf"),
    ("fused_zero.integrations.lightning", "lightning", "lightning"),
])
def test_missing_framework_names_the_extra(module, blocked, extra):
    r = _python(f"import sys; sys.modules[{blocked!r}] = None\n"
                f"try:\n    import {module}\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    assert r.returncode == 0, r.stderr
    packages = {"hf": "transformers accelerate", "lightning": "lightning"}[extra]
    assert f"pip install {packages} (or, in the fused_zero checkout, pip install -e '.[{extra}]')" in r.stdout, \
        r.stdout + r.stderr
