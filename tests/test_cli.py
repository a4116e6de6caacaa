"""The command line as a user meets it: `--help` on every subcommand, `--version`, typos and bad values as usage
errors (exit 2, the nearest key named), `doctor`'s versions, `report` on a malformed metrics line, one spelling of
the layout keys in `plan` and `train`, and `--force` where a message suggests it. Each case asserts the exit status
and the message; none runs the work it asks help about."""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

from mindspeed_flow import __version__, cli, doctor
from mindspeed_flow.runtime import report

SUBCOMMANDS = sorted(cli.SUBCOMMANDS) + [f"bench {b}" for b in sorted(cli.BENCHMARKS)] + ["bench"]
# a small plan: the tiny model on the CPU preset, few sample shapes
SMALL_PLAN = ("cluster=cpu", "model=tiny_qwen2_vl", "data=infovqa_tiny", "samples=64", "--no-baselines", "--job",
              "torch")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    """cli.main in this process; argparse's own exit (--help, a bad option) counts as the return code."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as stop:
        rc = stop.code if isinstance(stop.code, int) else 2
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_on_every_subcommand_prints_usage_and_does_nothing(command: str, capsys, tmp_path: Path,
                                                                monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, *command.split(), "--help")
    assert rc == 0, err
    assert "usage" in out.lower() or f"mindspeed-flow {command.split()[0]}" in out, out[:500]
    assert list(tmp_path.iterdir()) == []  # no run directory, no output file: nothing ran


def test_version_prints_the_package_version(capsys) -> None:
    rc, out, _ = _run(capsys, "--version")
    assert rc == 0 and out.strip() == f"mindspeed-flow {__version__}"


def test_unknown_command_names_the_nearest(capsys) -> None:
    rc, _, err = _run(capsys, "plna")
    assert rc == 2 and "unknown command 'plna'; did you mean 'plan'?" in err


def test_doctor_with_an_unknown_option_is_a_usage_error(capsys) -> None:
    rc, out, err = _run(capsys, "doctor", "--bogus")
    assert rc == 2 and "unrecognized arguments: --bogus" in err and "usage: mindspeed-flow doctor" in err
    assert "versions" not in out  # doctor did not run


def test_doctor_prints_versions_and_what_is_missing(capsys, tmp_path: Path, monkeypatch) -> None:
    toolkit = tmp_path / "ascend-toolkit" / "latest"
    (toolkit / "x86_64-linux").mkdir(parents=True)
    (toolkit / "x86_64-linux" / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\n"
                                                                          "version=8.1.RC1\n")
    mm = tmp_path / "MindSpeed-MM"
    mm.mkdir()
    (mm / ".source_commit").write_text("0123456789abcdef0123456789abcdef01234567\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(toolkit))
    monkeypatch.setenv("MINDSPEED_MM_HOME", str(mm))
    monkeypatch.delenv("MINDSPEED_HOME", raising=False)
    rc, out, _ = _run(capsys, "doctor")
    assert rc == 0
    head, missing = out.split("\nmissing", 1)
    lines = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in head.splitlines() if ":" in ln}
    assert lines["python"] and lines["torch"] == metadata.version("torch")
    assert lines["torch_npu"] == "not installed"
    assert lines["CANN"].startswith("8.1.RC1 (")
    assert lines["MindSpeed-MM"] == f"commit 0123456789ab (MINDSPEED_MM_HOME={mm})"
    assert lines["MindSpeed"].startswith("not found")
    for name in ("transformers", "ortools", "hydra", "device_type", "device_count", "backend"):
        assert lines[name], name
    assert "torch_npu: training on Ascend NPUs" in missing and "MindSpeed: " in missing
    assert "MindSpeed-MM:" not in missing and "CANN:" not in missing
    rc, out, _ = _run(capsys, "doctor", "--json")
    assert rc == 0 and json.loads(out)["versions"]["CANN"].startswith("8.1.RC1")


def test_cann_is_not_found_without_a_toolkit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(doctor, "CANN_DEFAULT", str(tmp_path / "absent"))
    assert doctor.cann_version({}) == "not found"


# ------------------------------------------------------------------------------------ plan
def test_plan_typo_is_a_usage_error_naming_the_nearest_key(capsys) -> None:
    rc, _, err = _run(capsys, "plan", *SMALL_PLAN, "modle=qwen2_5_vl_7b")
    assert rc == 2 and "unknown key 'modle'; did you mean 'model'?" in err and "infeasible" not in err


def test_plan_non_integer_devices_names_field_and_type(capsys) -> None:
    rc, _, err = _run(capsys, "plan", *SMALL_PLAN, "devices=abc")
    assert rc == 2 and err.strip() == "mindspeed-flow plan: devices='abc': expected a whole number"


def test_plan_unknown_option_is_a_usage_error(capsys) -> None:
    rc, _, err = _run(capsys, "plan", *SMALL_PLAN, "--forse")
    assert rc == 2 and "unknown option '--forse'; did you mean '--force'?" in err


def test_plan_takes_trains_layout_key_names(capsys) -> None:
    """`parallel.backbone.cp=1` (train's name) pins what the short alias `backbone.cp=1` pins; an unknown field of
    a part is a usage error."""
    plans = []
    for pin in ("parallel.backbone.pp=2", "backbone.pp=2"):
        rc, out, err = _run(capsys, "plan", *SMALL_PLAN, pin, "parallel.encoder.dp=1", "--json")
        assert rc == 0, err
        plans.append({p["name"]: (p["dp"], p["pp"]) for p in json.loads(out)["parts"]})
    assert plans[0] == plans[1] and plans[0]["backbone"][1] == 2 and plans[0]["encoder"][0] == 1
    rc, _, err = _run(capsys, "plan", *SMALL_PLAN, "parallel.backbone.ppp=2")
    assert rc == 2 and "did you mean 'parallel.backbone.pp'?" in err


def test_plan_out_refuses_an_existing_file_unless_forced(capsys, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    rc, _, err = _run(capsys, "plan", *SMALL_PLAN, "--out", str(recipe))
    assert rc == 0 and recipe.is_file(), err
    recipe.write_text("# mine\n")
    rc, _, err = _run(capsys, "plan", *SMALL_PLAN, "--out", str(recipe))
    assert rc == 2 and f"--out {recipe} already exists" in err and "--force" in err
    assert recipe.read_text() == "# mine\n"
    rc, out, err = _run(capsys, "plan", *SMALL_PLAN, "--out", str(recipe), "--force")
    assert rc == 0 and f"--force: replacing {recipe}" in err and f"recipe written to {recipe}" in out
    assert recipe.read_text() != "# mine\n"


# ------------------------------------------------------------------------------------ train
@pytest.mark.parametrize("override, message", [
    ("modle=tiny_qwen2_vl", "unknown key 'modle'; did you mean 'model'?"),
    ("trainer.stpes=2", "unknown key 'trainer.stpes'; did you mean 'trainer.steps'?"),
    ("+trainer.stpes=2", "unknown key 'trainer.stpes'; did you mean 'trainer.steps'?"),
    ("parallel.backbone.dp=abc", "parallel.backbone.dp: Value 'abc' of type 'str' could not be converted to Integer"),
    ("experiment=defualt", "experiment=defualt: no such recipe in recipes/experiment/; did you mean "
                           "experiment=default?"),
    ("--steps=2", "unknown option '--steps=2'"),
])
def test_train_typo_or_bad_value_is_a_usage_error(override: str, message: str, capsys, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rc, _, err = _run(capsys, "train", f"run_dir={run_dir}", override)
    assert rc == 2 and message in err, err
    assert not run_dir.exists()  # refused before the run directory is claimed


# ------------------------------------------------------------------------------------ report
def test_report_names_and_skips_malformed_metrics_lines(capsys, tmp_path: Path) -> None:
    good = {"step": 0, "loss": 2.0, "samples": 4, "step_seconds": 1.0, "padding_fraction": 0.1}
    lines = [json.dumps(good), '{"step": 1, "loss": 1.9', json.dumps({"loss": 1.8}),
             json.dumps({**good, "step": 3, "loss": 1.7})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rc = report.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 0, err
    path = tmp_path / "metrics.jsonl"
    assert f"{path}:2: skipped, not JSON" in err
    assert f"{path}:3: skipped, not a step record (no integer 'step')" in err
    assert "Traceback" not in err and (tmp_path / "report" / "curves.png").is_file()
