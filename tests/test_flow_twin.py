"""`mindspeed-flow launch-script RECIPE --from USER.sh`: the flow twin of a user's MindSpeed-MM launch script.

The twins of MindSpeed-MM's own example scripts (read from $MINDSPEED_MM_HOME/examples/qwen2.5vl at test time)
differ from them only in the lines the plan needs; the written script launches the flow entry with the plan's
launch size, logs per node, sets the socket variables and refuses a launch that cannot work with one line."""
from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.runtime import launch_script
from mindspeed_flow.runtime.flow_twin import BLOCK_END, BLOCK_START, ENTRY, HEADER_END
from mindspeed_flow.runtime.shell_words import UNKNOWN, Expander, split_words, statements

REPO = Path(__file__).resolve().parents[1]
TINY_SCRIPT = REPO / "scripts/examples/finetune_tiny_qwen2_5_vl.sh"
LAUNCH_VARS = ("NPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")
# example -> (recipe, {variable: its new value}); the entry line, the per-node log and the inserted header and
# check block are the only other changes
CASES = {
    "7b": ("defaults:\n  - override /cluster: atlas_800t_a2\nparallel:\n  encoder: {dp: 4, tp: 1, pp: 1, cp: 1}\n"
           "  backbone: {dp: 6, tp: 2, pp: 1, cp: 1}\ntrainer:\n  global_batch_size: 192\n",
           # 16 ranks on 2 A2 nodes; the decoder's TP 2 and PP 1 replace the job's TP 1 / PP 2, so the script's
           # DP (WORLD_SIZE/TP/PP/CP) is 8 and 24 accumulation steps keep its global batch of 192
           {"NPUS_PER_NODE": "${NPUS_PER_NODE:-8}", "MASTER_ADDR": "${MASTER_ADDR:-localhost}",
            "MASTER_PORT": "${MASTER_PORT:-6000}", "NNODES": "${NNODES:-2}", "NODE_RANK": "${NODE_RANK:-0}",
            "TP": "2", "PP": "1", "GRAD_ACC_STEP": "24",
            "logfile": "$(date +%Y%m%d)_$(date +%H%M%S)_node${NODE_RANK}"}),
    "3b": ("parallel:\n  encoder: {dp: 2, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 3, tp: 1, pp: 2, cp: 1}\n"
           "trainer:\n  global_batch_size: 96\n",
           # 8 ranks on the script's one node of 8; the recipe's global batch 96 (the script's was 256)
           {"NPUS_PER_NODE": "${NPUS_PER_NODE:-8}", "MASTER_ADDR": "${MASTER_ADDR:-localhost}",
            "MASTER_PORT": "${MASTER_PORT:-6000}", "NNODES": "${NNODES:-1}", "NODE_RANK": "${NODE_RANK:-0}",
            "PP": "2", "GRAD_ACC_STEP": "24", "logfile": "$(date +%Y%m%d)_$(date +%H%M%S)_node${NODE_RANK}"}),
    "72b": ("defaults:\n  - override /cluster: atlas_900_a3_384\nparallel:\n  encoder: {dp: 16, tp: 1, pp: 1, cp: 1}\n"
            "  backbone: {dp: 3, tp: 2, pp: 8, cp: 1}\n",
            # the hostfile launch keeps its lookups behind the environment; TP 2 / PP 8 are the recipe's already
            {"NPUS_PER_NODE": "${NPUS_PER_NODE:-16}",
             "MASTER_ADDR": "${MASTER_ADDR:-$(head -n1 $HOSTFILE | awk '{print $1;}')}",
             "MASTER_PORT": "${MASTER_PORT:-6000}",
             "NODE_RANK": "${NODE_RANK:-$(awk '{ranks[$1]=(FNR-1);}END{print ranks[\"'$NODE_ADDR'\"];}' $HOSTFILE)}",
             "NNODES": "${NNODES:-$(cat $HOSTFILE | wc -l)}",
             "logfile": "train_$(date +%Y%m%d)_$(date +%H%M%S)_node${NODE_RANK}"}),
}


def _examples() -> Path:
    """MindSpeed-MM's examples/qwen2.5vl: from $MINDSPEED_MM_HOME, else read out of the pinned sources archive
    (../shared/third_party beside the repository, or $MSF_SOURCES_ARCHIVE) into a temporary folder, once."""
    root = os.environ.get("MINDSPEED_MM_HOME")
    if root:
        folder = Path(root) / "examples/qwen2.5vl"
    else:
        folder = _examples_from_archive()
    if folder is None or not (folder / "finetune_qwen2_5_vl_7b.sh").is_file():
        pytest.skip("MindSpeed-MM sources absent (set MINDSPEED_MM_HOME, or keep the pinned archive in "
                    "../shared/third_party): the upstream example scripts are read from there")
    return folder


_FROM_ARCHIVE: dict[str, Path] = {}


def _examples_from_archive() -> "Path | None":
    import tarfile
    import tempfile

    archive = Path(os.environ.get("MSF_SOURCES_ARCHIVE") or
                   Path(__file__).resolve().parents[1].parent / "shared/third_party/mindspeed_mm_sources.tar.gz")
    if not archive.is_file():
        return None
    if "folder" not in _FROM_ARCHIVE:
        import atexit

        out = Path(tempfile.mkdtemp(prefix="msf-examples-"))
        atexit.register(shutil.rmtree, out, True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.startswith("MindSpeed-MM/examples/qwen2.5vl/") \
                        and member.name.endswith(".sh"):
                    (out / Path(member.name).name).write_bytes(tar.extractfile(member).read())
        _FROM_ARCHIVE["folder"] = out
    return _FROM_ARCHIVE["folder"]


def _twin(recipe_text: str, user: Path, tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    recipe = tmp_path / "flow.yaml"
    recipe.write_text(recipe_text)
    out = tmp_path / f"{user.stem}_flow.sh"
    assert launch_script.main([str(recipe), "--from", str(user), "--out", str(out), *extra]) == 0
    return recipe, out


def _inserted(lines: list[str]) -> set[int]:
    """Indices of the header and the check block the twin adds."""
    out, inside = set(), False
    for i, line in enumerate(lines):
        if line.startswith("# The flow twin of") or line.startswith(BLOCK_START):
            inside = True
        if inside:
            out.add(i)
        if line == BLOCK_END:
            inside = False
        if line == HEADER_END:
            inside = False
            out.add(i + 1)  # the --help line
    return out


def _changes(old: str, new: str) -> tuple[list[str], list[str]]:
    """(lines removed from old, lines added in new outside the inserted header and block)."""
    a, b = old.splitlines(), new.splitlines()
    skip = _inserted(b)
    removed, added = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += a[i1:i2]
            added += [b[j] for j in range(j1, j2) if j not in skip]
    return removed, added


@pytest.mark.parametrize("size", sorted(CASES))
def test_twin_of_upstream_example_changes_only_what_the_plan_needs(size: str, tmp_path: Path) -> None:
    user = _examples() / f"finetune_qwen2_5_vl_{size}.sh"
    recipe_text, new_values = CASES[size]
    recipe, out = _twin(recipe_text, user, tmp_path)
    original, twin = user.read_text(), out.read_text()
    removed, added = _changes(original, twin)
    old_lines = original.splitlines()
    entry = next(line for line in old_lines if line.startswith("torchrun "))
    assigned = {}
    for line in old_lines:
        m = re.match(r"^(\w+)=(.*?)(\s+#.*)?$", line)
        if m:
            assigned[m.group(1)] = (line, m.group(3) or "")
    expected_removed = {assigned[v][0] for v in new_values} | {entry}
    expected_added = {f"{v}={value}{assigned[v][1]}" for v, value in new_values.items()} | {
        entry.replace(" pretrain_vlm.py", ' -m mindspeed_flow_patches.launch --flow-recipe "$FLOW_RECIPE" '
                                          "pretrain_vlm.py"),
        "FLOW_STATUS=${PIPESTATUS[0]}  # mindspeed-flow: the script exits with torchrun's status",
        'exit "$FLOW_STATUS"'}
    assert sorted(removed) == sorted(expected_removed)
    assert sorted(added) == sorted(expected_added)
    # the flag strings, model, data and paths are the user's, verbatim
    for keep in ("MM_MODEL=", "MM_DATA=", "LOAD_PATH=", "SAVE_PATH=", "--clip-grad 0.0", "--log-tps",
                 "--num-workers 8", "--lr-warmup-fraction 0.1", "--no-load-optim"):
        assert [x for x in old_lines if keep in x] == [x for x in twin.splitlines() if keep in x]
    block = twin[twin.index(BLOCK_START):twin.index(BLOCK_END)]
    assert f"FLOW_RECIPE=${{FLOW_RECIPE:-{recipe}}}" in block
    assert 'flow_need_dir --load "$LOAD_PATH" read' in block and 'flow_need_dir --save "$SAVE_PATH" write' in block
    assert "GLOO_SOCKET_IFNAME=$FLOW_SOCKET_IFNAME HCCL_SOCKET_IFNAME=$FLOW_SOCKET_IFNAME" in block
    subprocess.run(["bash", "-n", str(out)], check=True)


def _stub_torchrun(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "torchrun"
    stub.write_text('#!/bin/bash\necho "torchrun $* | GLOO=${GLOO_SOCKET_IFNAME:-} HCCL=${HCCL_SOCKET_IFNAME:-}"\n'
                    'exit "${STUB_RC:-0}"\n')
    stub.chmod(0o755)
    return bin_dir


def _run(script: Path, cwd: Path, bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS + ("FLOW_RECIPE", "FLOW_SOCKET_IFNAME")}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=clean | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"} | env)


def test_twin_of_7b_launches_the_flow_entry_per_node(tmp_path: Path) -> None:
    """The 7B twin run with a stub torchrun: node 1's command, its own log, the socket variables, torchrun's exit
    status, and each refusal as one line."""
    recipe, out = _twin(CASES["7b"][0], _examples() / "finetune_qwen2_5_vl_7b.sh", tmp_path)
    bin_dir, work = _stub_torchrun(tmp_path), tmp_path / "mm"
    (work / "ckpt/mm_path/Qwen2.5-VL-7B-Instruct").mkdir(parents=True)
    proc = _run(out, work, bin_dir, NODE_RANK="1", MASTER_ADDR="10.0.0.1", FLOW_SOCKET_IFNAME="eth9")
    assert proc.returncode == 0, proc.stderr
    cmd = next(line for line in proc.stdout.splitlines() if line.startswith("torchrun "))
    assert cmd.startswith("torchrun --nproc_per_node 8 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --master_port "
                          f"6000 -m mindspeed_flow_patches.launch --flow-recipe {recipe} pretrain_vlm.py ")
    for flags in ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 1",
                  "--global-batch-size 192", "--load ckpt/mm_path/Qwen2.5-VL-7B-Instruct", "--clip-grad 0.0",
                  "--mm-model ./examples/qwen2.5vl/model_7b.json", "GLOO=eth9 HCCL=eth9"):
        assert flags in cmd
    logs = list((work / "logs").glob("train_*_node1.log"))
    assert len(logs) == 1 and cmd in logs[0].read_text()
    assert _run(out, work, bin_dir, STUB_RC="3").returncode == 3  # the script exits with torchrun's status
    refusals = [
        ({"NNODES": "3"}, "error: NNODES=3 x NPUS_PER_NODE=8 = 24 ranks, but the parts of"),
        ({"FLOW_RECIPE": str(tmp_path / "elsewhere.yaml")}, "is not readable on this node"),
    ]
    for env, message in refusals:
        proc = _run(out, work, bin_dir, **env)
        lines = [x for x in proc.stderr.splitlines() if "flow.sh: error:" in x]
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
        assert "torchrun --nproc" not in proc.stdout
    shutil.rmtree(work / "ckpt")
    proc = _run(out, work, bin_dir)
    assert proc.returncode == 2 and "--load ckpt/mm_path/Qwen2.5-VL-7B-Instruct is not readable on this node" in \
        proc.stderr


def test_twin_help_lists_what_it_reads_from_the_environment(tmp_path: Path) -> None:
    recipe, out = _twin((REPO / "recipes/mindspeed_mm/tiny_enc2_dec_tp2.yaml").read_text(), TINY_SCRIPT, tmp_path)
    proc = _run(out, tmp_path, _stub_torchrun(tmp_path), "--help")
    assert proc.returncode == 0 and "torchrun" not in proc.stdout.split("Environment it reads:")[1]
    listed = re.findall(r"^  (\w+)\s", proc.stdout, re.M)
    assert listed == ["NPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "TINY_WORKDIR",
                      "FLOW_RECIPE", "TRAIN_ITERS", "FLOW_SOCKET_IFNAME", "FLOW_LOG_DIR"], proc.stdout
    assert "2 node(s) x 2" in proc.stdout and "storage every node shares" in proc.stdout
    # without a log of its own, each node tees FLOW_LOG_DIR/train_<date>_node<rank>.log
    proc = _run(out, tmp_path, tmp_path / "bin", NODE_RANK="1", TINY_WORKDIR="/data/tiny",
                FLOW_LOG_DIR=str(tmp_path / "logs"))
    assert proc.returncode == 0, proc.stderr
    assert "--tensor-model-parallel-size 2" in proc.stdout and "--global-batch-size 4" in proc.stdout
    assert len(list((tmp_path / "logs").glob("train_*_node1.log"))) == 1


def test_twin_refuses_what_the_launch_cannot_match(tmp_path: Path, capsys) -> None:
    def refused(recipe_text: str, user: Path, *extra: str) -> str:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(recipe_text)
        assert launch_script.main([str(recipe), "--from", str(user), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    ten = "parallel:\n  encoder: {dp: 4, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 6, tp: 1, pp: 1, cp: 1}\n"
    assert "the recipe's 10 ranks (encoder 4 + backbone 6) do not fill nodes of 8 (NPUS_PER_NODE=8)" in \
        refused(ten, TINY_SCRIPT, "--npus-per-node", "8")
    assert "parallel.backbone.dp=6: --global-batch-size 4 must be divisible by --micro-batch-size 1 x dp" in \
        refused(ten, TINY_SCRIPT)  # the user's global batch of 4 cannot be shared by 6 decoder replicas
    assert "parallel.backbone.cp=2" in refused(ten.replace("dp: 6, tp: 1, pp: 1, cp: 1", "dp: 3, tp: 1, pp: 1, cp: 2"),
                                               TINY_SCRIPT)
    flow = REPO / "scripts/examples/finetune_tiny_qwen2_5_vl_flow.sh"
    assert "already runs mindspeed_flow_patches.launch" in refused(ten, flow)
    literal = tmp_path / "literal.sh"
    literal.write_text(TINY_SCRIPT.read_text().replace("--node_rank $NODE_RANK", "--node_rank 0"))
    assert "--node_rank 0 is written literally" in refused(ten, literal)
    other = tmp_path / "other.sh"
    other.write_text(TINY_SCRIPT.read_text().replace("pretrain_vlm.py", "evaluate_vlm.py"))
    assert "entry evaluate_vlm.py: evaluation, not training: run it unpatched" in refused(ten, other)
    assert "a flow job runs one of MindSpeed-MM's pretrain_vlm.py, pretrain_transformers.py, " \
           "mindspeed_mm/fsdp/train/trainer.py" in refused(ten, other)


def test_shell_words_reads_launch_script_shapes() -> None:
    text = ('#!/bin/bash\n# it\'s a comment with a quote\nA=${A:-4}  # trailing\nB="$((A * 2))"\n'
            'C=$(($B/$A/1))\nHOST=$(head -n1 hosts | awk \'{print $1;}\')\nARGS="\n    --x ${A} \\\n    --y "\n'
            "D='lit $A'\nE=${E:?set E}\ntorchrun $ARGS \\\n    run.py --z \"a b\" 2>&1 | tee log\n")
    stmts = statements(text)
    assert "\n".join(s.text for s in stmts) == text
    assert [s.assignment[0] for s in stmts if s.assignment] == ["A", "B", "C", "HOST", "ARGS", "D", "E"]
    ex = Expander()
    values = {name: ex.assign(name, raw) for name, raw in (s.assignment for s in stmts if s.assignment)}
    assert values["A"] == "4" and values["B"] == "8" and values["C"] == "2" and values["D"] == "lit $A"
    assert values["ARGS"].split() == ["--x", "4", "--y"] and UNKNOWN in values["HOST"] and values["E"] == UNKNOWN
    launch = next(s for s in stmts if s.text.startswith("torchrun"))
    assert split_words(launch.text) == ["torchrun", "$ARGS", "run.py", "--z", '"a b"', "2>&1", "|", "tee", "log"]
    assert Expander({"A": "7"}).word("${A:-4}") == "7"


def test_launch_script_from_needs_the_mm_job(tmp_path: Path, capsys) -> None:
    recipe = REPO / "recipes/mindspeed_mm/tiny_enc2_dec_tp2.yaml"
    assert launch_script.main([str(recipe), "--from", str(TINY_SCRIPT), "--job", "train"]) == 2
    assert "--from writes the flow twin of a MindSpeed-MM script" in capsys.readouterr().err
    out = tmp_path / "t.sh"
    assert launch_script.main([str(recipe), "--from", str(TINY_SCRIPT), "--out", str(out)]) == 0
    assert "changed: NNODES 1 -> ${NNODES:-2}, NODE_RANK 0 -> ${NODE_RANK:-0}, TP 1 -> 2, GRAD_ACC_STEP 2 -> 4" in \
        capsys.readouterr().err
    assert launch_script.main([str(recipe), "--from", str(TINY_SCRIPT), "--out", str(out)]) == 2
    assert "not overwriting" in capsys.readouterr().err
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if shellcheck:  # the twin of a script that passes shellcheck passes it too
        subprocess.run([shellcheck, str(out)], check=True, capture_output=True, text=True)


def test_twin_of_other_shapes(tmp_path: Path, monkeypatch) -> None:
    """`python -m torch.distributed.run`, the global batch computed in the flag string, CP from the environment,
    a launch without a log of its own (its m.json is no MindSpeed-MM file: the twin is not checked against one)."""
    monkeypatch.delenv("MINDSPEED_MM_HOME", raising=False)
    user = tmp_path / "mine.sh"
    user.write_text('#!/bin/bash\nGPUS=8\nHOST=localhost\nPORT=6000\nN=1\nR=0\nTP=${TP:-1}\nCP=${CP:-2}\nACC=3\n'
                    'ARGS="--tensor-model-parallel-size $TP --context-parallel-size $CP \\\n'
                    '    --micro-batch-size 1 --global-batch-size $((ACC*GPUS/TP/CP))"\n'
                    'python -m torch.distributed.run --nproc_per_node $GPUS --nnodes $N --node_rank $R \\\n'
                    '    --master_addr $HOST --master_port $PORT pretrain_vlm.py $ARGS --mm-model m.json\n')
    recipe = "parallel:\n  encoder: {dp: 2, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 6, tp: 1, pp: 1, cp: 1}\n"
    _, out = _twin(recipe, user, tmp_path)
    removed, added = _changes(user.read_text(), out.read_text())
    assert sorted(removed) == sorted([
        "GPUS=8", "HOST=localhost", "PORT=6000", "N=1", "R=0", "CP=${CP:-2}",
        "    --micro-batch-size 1 --global-batch-size $((ACC*GPUS/TP/CP))\"",
        "    --master_addr $HOST --master_port $PORT pretrain_vlm.py $ARGS --mm-model m.json"])
    # the user's global batch (3 x 8 / 1 / 2 = 12) kept as a number once CP is the recipe's
    assert sorted(added) == sorted([
        "GPUS=${GPUS:-8}", "HOST=${HOST:-localhost}", "PORT=${PORT:-6000}", "N=${N:-1}", "R=${R:-0}",
        "CP=${CP:-1}", "    --micro-batch-size 1 --global-batch-size 12\"",
        '    --master_addr $HOST --master_port $PORT -m mindspeed_flow_patches.launch --flow-recipe "$FLOW_RECIPE" '
        'pretrain_vlm.py $ARGS --mm-model m.json 2>&1 | tee "$FLOW_LOG"',
        "FLOW_STATUS=${PIPESTATUS[0]}  # mindspeed-flow: the script exits with torchrun's status",
        'exit "$FLOW_STATUS"'])
    proc = _run(out, tmp_path, _stub_torchrun(tmp_path), "--help")
    assert re.findall(r"^  (\w+)\s", proc.stdout, re.M)[:7] == ["GPUS", "HOST", "PORT", "N", "R", "TP", "CP"]


# Every launch script MindSpeed-MM ships at the pinned commit, and what `launch-script --from` makes of it under an
# encoder 4 + LLM 4 recipe: the flow entry the twin runs, or the words its one-line refusal must hold. A script a
# re-pinned MindSpeed-MM adds fails the test until it is classified here.
EXAMPLE_TWINS = {
    "glm4.5v/finetune_glm4_5v_106B.sh": "pretrain_transformers.py",
    "qwen2.5omni/finetune_qwen2_5_omni_7b.sh": "pretrain_vlm.py",
    "qwen2.5vl/finetune_qwen2_5_vl_3b.sh": "pretrain_vlm.py",
    "qwen2.5vl/finetune_qwen2_5_vl_7b.sh": "pretrain_vlm.py",
    "qwen2.5vl/finetune_qwen2_5_vl_32b.sh": "pretrain_vlm.py",
    "qwen2.5vl/finetune_qwen2_5_vl_72b.sh": "pretrain_vlm.py",
    "qwen3vl/finetune_qwen3vl_8B.sh": "pretrain_transformers.py",
    "qwen3vl/finetune_qwen3vl_30B.sh": "pretrain_transformers.py",
    "qwen3vl/finetune_qwen3vl_32B.sh": "pretrain_transformers.py",
    "qwen3vl/finetune_qwen3vl_235B.sh": "pretrain_transformers.py",
    "qwen3vl/finetune_qwen3vl_30B_v1.sh": "mindspeed_mm/fsdp/train/trainer.py",
    "qwen3vl/finetune_qwen3vl_30B_v1_A5.sh": "mindspeed_mm/fsdp/train/trainer.py",
}
EXAMPLE_REFUSALS = {
    "internvl3.5/finetune_internvl3_5.sh": "model_id='internvl'",
    "mcore/qwen3_5/finetune_qwen3_5_35B.sh": "Qwen3.5 on MindSpeed-MM's mcore path",
    "qwen2.5vl/evaluate_qwen2_5_vl_7b.sh": "evaluation, not training",
    "qwen2.5vl/evaluate_qwen2_5_vl_72b.sh": "evaluation, not training",
    "qwen2.5vl/inference_qwen2_5_vl_7b.sh": "inference, not training",
    "qwen2.5vl/inference_qwen2_5_vl_72b.sh": "inference, not training",
    "qwen2.5vl/finetune_qwen2_5_vl_72b_fsdp.sh": "--use-torch-fsdp2",
    "qwen3omni/finetune_qwen3omni.sh": "model_id='qwen3_omni_moe'",
    "qwen3omni/finetune_qwen3omni_v1.sh": "model.model_id='qwen3_omni_moe'",
    "qwen3vl/finetune_lora_qwen3vl_30B.sh": "lora_args",
}
# the pieces of the sources a twin reads: the examples, and the entry scripts that mark MindSpeed-MM's folder
_MM_PIECES = ("examples/", "pretrain_vlm.py", "pretrain_transformers.py", "mindspeed_mm/fsdp/train/trainer.py")


def _mm_root() -> Path:
    """A MindSpeed-MM folder (its examples and entry scripts): $MINDSPEED_MM_HOME, else read out of the pinned
    sources archive into a temporary folder, once."""
    root = os.environ.get("MINDSPEED_MM_HOME")
    if root and (Path(root) / "pretrain_vlm.py").is_file():
        return Path(root)
    if "root" not in _FROM_ARCHIVE:
        import atexit
        import tarfile
        import tempfile

        archive = Path(os.environ.get("MSF_SOURCES_ARCHIVE") or REPO.parent / "shared/third_party/"
                       "mindspeed_mm_sources.tar.gz")
        if not archive.is_file():
            pytest.skip("MindSpeed-MM sources absent (set MINDSPEED_MM_HOME, or keep the pinned archive in "
                        "../shared/third_party)")
        out = Path(tempfile.mkdtemp(prefix="msf-mm-root-"))
        atexit.register(shutil.rmtree, out, True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                rel = member.name.partition("/")[2]
                if member.isfile() and member.name.startswith("MindSpeed-MM/") and \
                        any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in _MM_PIECES):
                    (out / rel).parent.mkdir(parents=True, exist_ok=True)
                    (out / rel).write_bytes(tar.extractfile(member).read())
        _FROM_ARCHIVE["root"] = out
    return _FROM_ARCHIVE["root"]


def test_every_upstream_launch_script_gets_a_checked_twin_or_one_line_refusal(tmp_path: Path, capsys) -> None:
    """MindSpeed-MM's own launch scripts, each as shipped: the twin of each training job the flow launcher accepts
    (its command checked against the job's own model / data / CONFIG files, as the launcher checks it at start-up),
    and for every other script one line saying why, with nothing written."""
    root = _mm_root()
    recipe = tmp_path / "flow.yaml"
    recipe.write_text("parallel:\n  encoder: {dp: 4, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 4, tp: 1, pp: 1, cp: 1}\n")
    scripts = sorted(p.relative_to(root / "examples").as_posix() for p in (root / "examples").rglob("*.sh"))
    assert sorted(set(EXAMPLE_TWINS) | set(EXAMPLE_REFUSALS)) == scripts, "classify every shipped launch script"
    wrong = []
    for rel in scripts:
        out = tmp_path / rel.replace("/", "_")
        rc = launch_script.main([str(recipe), "--from", str(root / "examples" / rel), "--npus-per-node", "8",
                                 "--mm-root", str(root), "--out", str(out)])
        err = capsys.readouterr().err.strip()
        if rel in EXAMPLE_TWINS:
            entry = EXAMPLE_TWINS[rel]
            launch = next((line for line in out.read_text().splitlines() if line.startswith("torchrun")), "") \
                if out.exists() else ""
            if rc != 0 or f'{ENTRY} {entry}' not in launch or "note:" in err:
                wrong.append(f"{rel}: rc {rc}, launch {launch!r}, {err[-300:]!r}")
        elif rc != 2 or out.exists() or len(err.splitlines()) != 1 or EXAMPLE_REFUSALS[rel] not in err:
            wrong.append(f"{rel}: rc {rc}, written {out.exists()}, {err[-300:]!r}")
    assert not wrong, "\n".join(wrong)


def test_twin_is_refused_when_the_job_cannot_run_decoupled(tmp_path: Path, capsys) -> None:
    """A twin whose command the launcher would refuse at start-up is refused here: the 8B example with a global
    batch the LLM's data-parallel ranks cannot share (its CONFIG.yaml's 8 over 3 ranks)."""
    root = _mm_root()
    recipe = tmp_path / "flow.yaml"
    recipe.write_text("parallel:\n  encoder: {dp: 1, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 3, tp: 1, pp: 1, cp: 1}\n")
    out = tmp_path / "twin.sh"
    rc = launch_script.main([str(recipe), "--from", str(root / "examples/qwen3vl/finetune_qwen3vl_8B.sh"),
                             "--mm-root", str(root), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not out.exists(), err
    assert "finetune_qwen3vl_8B.sh cannot run as a flow job" in err and "parallel.backbone.dp=3" in err, err


def test_twin_without_the_mindspeed_mm_folder_says_what_was_not_checked(tmp_path: Path, capsys) -> None:
    """A script copied away from MindSpeed-MM, with no MINDSPEED_MM_HOME: the twin is written and the note says the
    job's own files were not checked (the launcher checks them at start-up)."""
    user = tmp_path / "mine.sh"
    user.write_text((_mm_root() / "examples/qwen3vl/finetune_qwen3vl_8B.sh").read_text())
    recipe = tmp_path / "flow.yaml"
    recipe.write_text("parallel:\n  encoder: {dp: 4, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 4, tp: 1, pp: 1, cp: 1}\n")
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_MM_HOME"}
    run = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "launch-script", str(recipe), "--from",
                          str(user), "--out", str(tmp_path / "twin.sh")], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert "the job's own files were not checked (no MindSpeed-MM folder found: pass --mm-root)" in run.stderr
    assert f"{ENTRY} pretrain_transformers.py" in (tmp_path / "twin.sh").read_text()


def test_twin_takes_what_each_entry_checks(tmp_path: Path, capsys) -> None:
    """A coupled plan (what `plan` writes when a coupled baseline wins) has no twin: one line, not a traceback. The
    Megatron flow host's own recipe rules (here packing.pad_multiple) refuse its entry's twin, while an FSDP2 entry,
    which packs nothing, gets its twin under the same recipe."""
    root = _mm_root()
    parts = "parallel:\n  encoder: {dp: 4, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 4, tp: 1, pp: 1, cp: 1}\n"
    for text, user, rc, words in (
            ("flow:\n  mode: coupled\n" + parts + "  coupled: {pp: 1}\n", "qwen3vl/finetune_qwen3vl_8B.sh", 2,
             "flow.mode='coupled': a coupled plan is the unpatched job itself"),
            (parts + "packing:\n  pad_multiple: 8\n", "qwen2.5vl/finetune_qwen2_5_vl_7b.sh", 2,
             "packing.pad_multiple=8"),
            (parts + "packing:\n  pad_multiple: 8\n", "qwen3vl/finetune_qwen3vl_8B.sh", 0, "flow twin of")):
        recipe = tmp_path / "flow.yaml"
        recipe.write_text(text)
        out = tmp_path / "twin.sh"
        out.unlink(missing_ok=True)
        got = launch_script.main([str(recipe), "--from", str(root / "examples" / user), "--mm-root", str(root),
                                  "--npus-per-node", "8", "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert got == rc and words in err and len(err.splitlines()) == 1 and out.exists() == (rc == 0), (user, err)
