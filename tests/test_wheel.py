"""The wheel, installed as a user installs it (not editable), plans, writes launch scripts and runs doctor from an
empty folder: the recipes and the Ascend script templates travel inside the package (mindspeed_flow/resources.py).

The wheel is built offline from a copy of the sources (the checkout gets no build/ or .egg-info), installed with
no dependencies into a fresh venv, and only then is the running interpreter's site-packages made visible to that
venv through a .pth file: a directory added that way does not have its own .pth files processed, so an editable
install of this repository there cannot leak in (the test checks where mindspeed_flow is imported from).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mindspeed_flow import __version__
from mindspeed_flow.resources import DATA_TREES

REPO = Path(__file__).resolve().parents[1]
# the planner arguments of the A2 example (docs/ascend.md), with fewer sample shapes
PLAN = ["cluster=atlas_800t_a2", "model=qwen2_5_vl_7b", "devices=16", "data=infovqa_1280", "samples=128",
        "parallel.backbone.cp=1", "parallel.encoder.cp=1", "parallel.backbone.recompute=0",
        "parallel.encoder.recompute=0", "planner.distributed_optimizer=false", "--no-baselines"]


def _run(cmd: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel (its bin/ folder)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for tree in ("mindspeed_flow", "patches", *DATA_TREES):
        shutil.copytree(REPO / tree, src / tree, ignore=ignore)
    shutil.copy2(REPO / "setup.py", src / "setup.py")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", root / "dist", src], cwd=root)
    wheel = next((root / "dist").glob("mindspeed_flow-*.whl"))
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], cwd=root)
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    # the dependencies (torch, hydra, ortools, ...): the running interpreter's site-packages, added after the install
    shared = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "_msf_test_dependencies.pth").write_text("\n".join(shared) + "\n")
    return venv / "bin"


def test_installed_wheel_plans_writes_scripts_and_runs_doctor_from_an_empty_folder(installed: Path,
                                                                                    tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MSF_RECIPES")}
    where = _run([installed / "python", "-c", "import mindspeed_flow, mindspeed_flow.resources as r; "
                  "print(mindspeed_flow.__file__); print(r.data_path('recipes')); print(r.data_path('scripts/ascend'))"],
                 cwd=tmp_path, env=env).stdout.split()
    venv = installed.parent.resolve()
    assert all(Path(p).resolve().is_relative_to(venv) for p in where), where  # the wheel's copy, not the checkout
    cli = installed / "mindspeed-flow"
    assert _run([cli, "--version"], cwd=tmp_path, env=env).stdout.strip() == f"mindspeed-flow {__version__}"
    plan = _run([cli, "plan", *PLAN, "--out", "flow_a2.yaml", "--launch-script", "train_flow_a2.sh"], cwd=tmp_path,
                env=env)
    assert "launch script written to train_flow_a2.sh" in plan.stdout
    assert "FLOW_RECIPE=" in (tmp_path / "train_flow_a2.sh").read_text()
    _run([cli, "launch-script", "flow_a2.yaml", "--out", "again.sh"], cwd=tmp_path, env=env)
    assert (tmp_path / "again.sh").read_text() == (tmp_path / "train_flow_a2.sh").read_text()
    doctor = _run([cli, "doctor"], cwd=tmp_path, env=env).stdout
    assert f"mindspeed-flow: {__version__}" in doctor and "device_type:" in doctor
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.sh", "flow_a2.yaml", "train_flow_a2.sh"]
