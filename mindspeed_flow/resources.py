"""Where the files the commands read at run time live: the recipe tree (`recipes/`: train, plan) and the Ascend
launch-script templates (`scripts/ascend/`: launch-script, plan --launch-script).

In a source checkout (and an editable install) they sit at the repository root, beside the package. A built wheel
carries them inside the package as `mindspeed_flow/_data/recipes` and `mindspeed_flow/_data/scripts/ascend`
(setup.py's build step copies them there), so a non-editable install finds them without the repository.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# the folders a wheel carries, as paths relative to the repository root (and to mindspeed_flow/_data/)
DATA_TREES = ("recipes", "scripts/ascend")


def data_path(tree: str) -> Path:
    """`tree` (one of DATA_TREES) inside the installed package, else at the repository root."""
    if tree not in DATA_TREES:
        raise ValueError(f"{tree!r} is not a packaged data tree; one of {DATA_TREES}")
    packaged = PACKAGE_DIR / "_data" / tree
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / tree
