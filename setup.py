from setuptools import setup

# Triton ships wheels for Linux on x86_64 and aarch64 only. torch's CUDA wheels there already
# depend on it; CPU-only installs never import it, except the tests, which run the kernels
# under Triton's interpreter.
TRITON = ('triton; platform_system == "Linux" and '
          '(platform_machine == "x86_64" or platform_machine == "aarch64")')

setup(
    name="fused_zero",
    version="0.1.0",
    description="ZeRO stages 1-3 with fused Triton AdamW kernels, a drop-in for torch.optim",
    python_requires=">=3.10",
    # The top-level kernels/ folder ships as fused_zero.kernels: no generic
    # top-level name lands in site-packages.
    packages=["fused_zero", "fused_zero.comm", "fused_zero.sharding", "fused_zero.tiers", "fused_zero.ops",
              "fused_zero.plan", "fused_zero.checkpoint", "fused_zero.integrations", "fused_zero.kernels"],
    package_dir={"fused_zero": "fused_zero", "fused_zero.kernels": "kernels"},
    install_requires=["torch>=2.4", "numpy", "safetensors"],
    extras_require={
        # torch's optimizer test inputs (expecttest), the plan picture, and the frameworks the
        # integration tests train with
        "test": [TRITON, "pytest", "pytest-benchmark", "expecttest", "matplotlib",
                 "transformers>=5", "accelerate>=1.10", "lightning>=2.5", "peft>=0.21"],
        "plot": ["matplotlib"],
        "hf": ["transformers>=5", "accelerate>=1.10"],   # ZeroTrainer, ZeroAccelerator
        "lightning": ["lightning>=2.5"],                  # ZeroStrategy
        "gpu": [TRITON],   # for a torch build on a GPU machine that lacks it
    },

)
