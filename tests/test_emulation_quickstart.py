"""The emulator as a newcomer meets it: source checks, caller-relative paths, torchvision compat, --setup and
--print-command (no MindSpeed-MM sources needed: fake trees with the real markers and commit stamps)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from mindspeed_flow import emulation
from mindspeed_flow.emulation import cli, quickstart
from mindspeed_flow.emulation.sources import (COMMIT_FILE, MARKERS, TESTED_COMMITS, SourceError, find_sources,
                                              make_archive, read_commit)

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path, name: str, commit: str | None) -> Path:
    (root / MARKERS[name]).parent.mkdir(parents=True, exist_ok=True)
    (root / MARKERS[name]).write_text("")
    if commit is not None:
        (root / COMMIT_FILE).write_text(commit + "\n")
    return root


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    roots = {name: _tree(tmp_path / "src" / name, name, TESTED_COMMITS[name]) for name in TESTED_COMMITS}
    (roots["MindSpeed-MM"] / "pretrain_vlm.py").write_text("")
    (roots["MindSpeed-MM"] / "mindspeed_mm/tools").mkdir(parents=True)
    (roots["MindSpeed-MM"] / "mindspeed_mm/tools/tools.json").write_text("{}")
    for name, var in (("MindSpeed-MM", "MINDSPEED_MM_HOME"), ("MindSpeed", "MINDSPEED_HOME"),
                      ("Megatron-LM", "MEGATRON_HOME")):
        monkeypatch.setenv(var, str(roots[name]))
    return roots


# ------------------------------------------------------------------------------------ the two bugs
@pytest.mark.parametrize("content, found", [("", "it is empty"), ("\n  \n", "it is empty"),
                                            ("not-a-hash\n", "'not-a-hash'")])
def test_bad_source_commit_file_is_one_clear_error(sources, content: str, found: str, capsys) -> None:
    stamp = sources["MindSpeed"] / COMMIT_FILE
    stamp.write_text(content)
    with pytest.raises(SourceError, match=r"must hold the full 40-hex commit"):
        read_commit(sources["MindSpeed"])
    assert cli.main(["--dry-run", "--", "pretrain_vlm.py"]) == 2
    err = capsys.readouterr().err
    assert str(stamp) in err and found in err and "Traceback" not in err
    assert stamp.read_text() == content  # the user's file is left as it was


def test_script_relative_to_the_callers_folder_runs_from_there(sources, tmp_path: Path, monkeypatch,
                                                               capsys) -> None:
    caller = tmp_path / "me"
    (caller / "jobs").mkdir(parents=True)
    (caller / "jobs/my_pretrain.py").write_text("")
    (caller / "data.json").write_text("{}")
    monkeypatch.chdir(caller)
    assert cli.main(["--dry-run", "--", "jobs/my_pretrain.py", "--mm-data", "data.json", "--mm-tool",
                     "mindspeed_mm/tools/tools.json", "--save=ckpt", "--load", "/abs/ckpt"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1].split()
    assert str(caller / "jobs/my_pretrain.py") in cmd
    assert cmd[cmd.index("--mm-data") + 1] == str(caller / "data.json")
    assert cmd[cmd.index("--mm-tool") + 1] == "mindspeed_mm/tools/tools.json"  # only in MindSpeed-MM's tree
    assert f"--save={caller / 'ckpt'}" in cmd  # outputs are the caller's, never the sources'
    assert cmd[cmd.index("--load") + 1] == "/abs/ckpt"
    # MindSpeed-MM's own script still resolves in its root; a script that is nowhere names both places
    assert cli.main(["--dry-run", "--", "pretrain_vlm.py"]) == 0
    capsys.readouterr()
    assert cli.main(["--dry-run", "--", "jobs/missing.py"]) == 2
    err = capsys.readouterr().err
    assert str(caller) in err and str(sources["MindSpeed-MM"]) in err


def test_yaml_config_relative_to_the_callers_folder_is_made_absolute(sources, tmp_path: Path, monkeypatch,
                                                                     capsys) -> None:
    """`pretrain_transformers.py CONFIG.yaml` and the FSDP2 trainer take the config as their first argument."""
    caller = tmp_path / "me"
    (caller / "cfg").mkdir(parents=True)
    (caller / "cfg/sft.yaml").write_text("gpt_args: {}\n")
    (sources["MindSpeed-MM"] / "pretrain_transformers.py").write_text("")
    monkeypatch.chdir(caller)
    assert cli.main(["--dry-run", "--", "pretrain_transformers.py", "cfg/sft.yaml", "--distributed-backend",
                     "nccl"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1].split()
    assert cmd[cmd.index("pretrain_transformers.py") + 1] == str(caller / "cfg/sft.yaml")
    # a config only in MindSpeed-MM's tree (its examples) stays relative to it
    assert cli.main(["--dry-run", "--", "pretrain_transformers.py", "examples/qwen3vl/x.yaml"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1].split()
    assert cmd[cmd.index("pretrain_transformers.py") + 1] == "examples/qwen3vl/x.yaml"


def test_dry_run_with_a_shell_script_runs_nothing(sources, tmp_path: Path, capsys) -> None:
    """`emulate --dry-run --shell SCRIPT` prints what it would run (folder, PYTHONPATH, mode, `bash SCRIPT`)."""
    marker = tmp_path / "ran"
    script = tmp_path / "launch.sh"
    script.write_text(f"touch {marker}\n")
    assert cli.main(["--dry-run", "--shell", str(script)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"cd {sources['MindSpeed-MM']}" and out[-1] == f"bash {script}"
    assert any(line.startswith("PYTHONPATH=") for line in out) and not marker.exists()
    assert cli.main(["--dry-run", "--setup", str(tmp_path / "setup")]) == 0
    assert "would prepare" in capsys.readouterr().out and not (tmp_path / "setup").exists()


# ------------------------------------------------------------------------------------ torchvision compat
def test_torchvision_compat_applies_itself_under_emulation(tmp_path: Path) -> None:
    probe = textwrap.dedent("""
        import sys
        assert "torch" not in sys.modules, "the start-up hook must not import torch"
        try:
            import torchvision  # noqa: F401
            result = "ok"
        except ImportError:
            result = "missing"  # not installed in this venv: the hook still ran on the lookup
        except RuntimeError as err:
            result = "failed"  # the CUDA wheel next to CPU torch, without the compat layer
        import torch.library
        print("COMPAT", getattr(torch.library.register_fake, "_msf_emulated", False), result)
    """)
    env = emulation.site_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    on = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300,
                        cwd=tmp_path)
    assert on.returncode == 0, on.stderr[-3000:]
    assert "COMPAT True" in on.stdout and "failed" not in on.stdout
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)})
    assert "COMPAT False" in off.stdout, off.stderr[-3000:]  # outside emulation nothing changes


def test_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins; builtins.MSF_OTHER_SITE = True\n")
    env = emulation.site_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(other)})
    proc = subprocess.run([sys.executable, "-c", "import builtins, sys; print(builtins.MSF_OTHER_SITE, "
                           "*sorted(getattr(f, 'fullname', type(f).__name__) for f in sys.meta_path[:2]))"], env=env,
                          capture_output=True, text=True, timeout=120)
    # the emulation's own import hooks (torchvision's compat layer, triton's NPU driver) come first
    assert proc.stdout.split() == ["True", "_TorchvisionCompatOnImport", "triton.runtime.driver"], \
        proc.stderr[-2000:]


# ------------------------------------------------------------------------------------ --setup
def _archive(tmp_path: Path, names=tuple(TESTED_COMMITS)) -> Path:
    src = tmp_path / "pack"
    for name in names:
        _tree(src / name, name, TESTED_COMMITS[name])
    out = tmp_path / "sources.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for name in names:
            tar.add(src / name, arcname=name)
    return out


@pytest.fixture
def no_source_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MINDSPEED_MM_HOME", "MINDSPEED_HOME", "MEGATRON_HOME", quickstart.TINY_ENV):
        monkeypatch.delenv(var, raising=False)


def test_setup_from_archive_builds_sources_assets_and_env(tmp_path: Path, no_source_env, capsys) -> None:
    work = tmp_path / "emu"
    rc = cli.main(["--setup", str(work), "--sources-archive", str(_archive(tmp_path))])
    found = find_sources(*(str(work / "sources" / n) for n in ("MindSpeed-MM", "MindSpeed", "Megatron-LM")), env={})
    assert [t.commit for t in found.trees()] == [TESTED_COMMITS[n] for n in ("MindSpeed-MM", "MindSpeed",
                                                                             "Megatron-LM")]
    problem = quickstart.dependency_problem()
    if problem:  # e.g. transformers 5 in the plain test venv: the sources are ready, the assets need the extra
        assert rc == 2 and "sources ready" in capsys.readouterr().err and not (work / "env.sh").exists()
        pytest.skip(f"tiny assets need MindSpeed-MM's dependencies: {problem}")
    assert rc == 0
    out = capsys.readouterr().out
    assert f"source {work / 'env.sh'}" in out and "--print-command" in out
    env = dict(line[len("export "):].split("=", 1) for line in (work / "env.sh").read_text().splitlines()
               if line.startswith("export "))
    assert find_sources(env=env) == found
    tiny = Path(env[quickstart.TINY_ENV])
    for name in ("model.json", "model_pp2.json", "data.json", "processor/tokenizer.json", "data/samples.json"):
        assert (tiny / name).is_file(), name
    # again: the trees are reused, nothing is unpacked over them
    marker = work / "sources/MindSpeed/mine.txt"
    marker.write_text("user file")
    assert cli.main(["--setup", str(work), "--sources-archive", str(_archive(tmp_path / "2"))]) == 0
    assert "already holds the three trees" in capsys.readouterr().out and marker.read_text() == "user file"


def test_setup_refuses_what_it_cannot_do_safely(tmp_path: Path, no_source_env, capsys) -> None:
    assert cli.main(["--setup", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "--sources-archive" in err and "--fetch" in err and "MINDSPEED_MM_HOME" in err
    partial = _archive(tmp_path / "p", names=("MindSpeed-MM", "MindSpeed"))
    assert cli.main(["--setup", str(tmp_path / "b"), "--sources-archive", str(partial)]) == 2
    assert "expected top-level folders" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c/env.sh").write_text("export MINE=1\n")
    with pytest.raises(SourceError, match="not written by --setup"):
        quickstart.write_env(tmp_path / "c/env.sh", {"A": "1"})
    assert (tmp_path / "c/env.sh").read_text() == "export MINE=1\n"


def test_archive_of_git_checkouts_carries_their_commits(tmp_path: Path) -> None:
    root = tmp_path / "checkouts"
    heads = {}
    for name in TESTED_COMMITS:
        tree = _tree(root / name, name, None)
        git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-qm", "x"], check=True)
        heads[name] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                     check=True).stdout.strip()
    out = make_archive(root, tmp_path / "s.tar.gz")
    with tarfile.open(out) as tar:
        names = tar.getnames()
        assert not any("/.git/" in f"/{n}/" for n in names)
        for name, head in heads.items():
            assert tar.extractfile(f"{name}/{COMMIT_FILE}").read().decode().strip() == head
    with pytest.raises(SourceError, match="not overwriting"):
        make_archive(root, out)


# ------------------------------------------------------------------------------------ --print-command
@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny"
    d.mkdir()
    for name in ("model.json", "model_pp2.json", "data.json"):
        (d / name).write_text("{}")
    return d


@pytest.mark.parametrize("layout, nproc, tp, pp, sp", [("dp2", 2, 1, 1, False), ("tp2sp", 2, 2, 1, True),
                                                       ("pp2", 2, 1, 2, False), ("dp2pp2", 4, 1, 2, False)])
def test_print_command_gives_a_line_for_each_layout(tiny_dir: Path, layout, nproc, tp, pp, sp, capsys) -> None:
    assert cli.main(["--print-command", "--tiny", str(tiny_dir), "--layout", layout]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[:4] == ["mindspeed-flow", "emulate", "--nproc", str(nproc)]
    job = argv[argv.index("--") + 1:]
    assert job[0] == "pretrain_vlm.py"
    value = lambda flag: job[job.index(flag) + 1]  # noqa: E731
    assert (value("--tensor-model-parallel-size"), value("--pipeline-model-parallel-size")) == (str(tp), str(pp))
    assert value("--mm-model") == str(tiny_dir / ("model_pp2.json" if pp > 1 else "model.json"))
    assert int(value("--global-batch-size")) % (nproc // tp // pp) == 0
    for flag in ("--bf16", "--no-gradient-accumulation-fusion"):  # what a CPU run needs
        assert flag in job
    assert ("--variable-seq-lengths" in job) == (pp > 1) and ("--sequence-parallel" in job) == sp


def test_print_command_flow_job_and_errors(tiny_dir: Path, tmp_path: Path, no_source_env, capsys) -> None:
    recipe = REPO / "recipes/mindspeed_mm/tiny_enc1_dec_pp2.yaml"
    assert cli.main(["--print-command", "--tiny", str(tiny_dir), "--flow-recipe", str(recipe)]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[2:6] == ["--nproc", "3", "--flow-recipe", str(recipe)]
    assert argv[argv.index("--mm-model") + 1] == str(tiny_dir / "model_pp2.json")
    assert cli.main(["--print-command", "--layout", "dp2"]) == 2
    assert quickstart.TINY_ENV in capsys.readouterr().err
    assert cli.main(["--print-command", "--tiny", str(tmp_path / "none")]) == 2
    assert "--setup" in capsys.readouterr().err
    assert cli.main(["--print-command", "--tiny", str(tiny_dir), "--layout", "tp4"]) == 2
    assert "tp <= 2" in capsys.readouterr().err
