"""The hosted-CI workflow (.github/workflows/ci.yml) calls only scripts that exist, and the pinned-sources fetch
(git by commit, then the archive with .source_commit) works end to end against local git repositories standing in
for the upstreams."""
from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from mindspeed_flow.emulation import sources
from mindspeed_flow.emulation.sources import COMMIT_FILE, MARKERS, TESTED_COMMITS, find_sources

REPO = Path(__file__).resolve().parents[1]


def test_workflow_jobs_run_repository_scripts() -> None:
    wf = yaml.safe_load((REPO / ".github/workflows/ci.yml").read_text())
    assert set(wf["jobs"]) == {"lint", "unit", "multirank", "mindspeed-mm"}
    runs = {job: [s["run"] for s in spec["steps"] if "run" in s] for job, spec in wf["jobs"].items()}
    for job, commands in runs.items():
        for cmd in commands:
            for script in re.findall(r"bash (\S+)", cmd):
                assert (REPO / script).is_file(), (job, script)
    assert any("ci/emulation.sh" in c for c in runs["mindspeed-mm"])
    assert all(s["torch"] == ["current", "2.7"] for s in (wf["jobs"][j]["strategy"]["matrix"]
                                                         for j in ("unit", "multirank", "mindspeed-mm")))
    emulation = (REPO / "ci/emulation.sh").read_text()
    assert "ci/fetch_sources.sh" in emulation and "scripts/run_mindspeed_mm_tests.sh" in emulation
    assert "scripts/run_tests.sh" in (REPO / ".ci/run").read_text()  # the README's entry stays
    # torch as the README installs it: pinned by scripts/constraints*.txt, the CPU wheels from PyTorch's index
    assert wf["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert not list((REPO / "ci").glob("*.yml"))  # one workflow definition, where the service reads it


def _upstream(root: Path, name: str) -> str:
    """A git repository with `name`'s marker file and two commits; returns the first (the "tested" one)."""
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    (root / MARKERS[name]).parent.mkdir(parents=True)
    (root / MARKERS[name]).write_text("v1\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "tested"], check=True)
    tested = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (root / MARKERS[name]).write_text("v2\n")
    subprocess.run(git + ["commit", "-qam", "newer"], check=True)
    return tested


def test_fetch_by_commit_and_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for name in TESTED_COMMITS:
        commit = _upstream(tmp_path / "upstream" / name, name)
        monkeypatch.setitem(TESTED_COMMITS, name, commit)
        monkeypatch.setenv(f"MSF_{name.upper().replace('-', '_')}_URL", (tmp_path / "upstream" / name).as_uri())
    dest, archive = tmp_path / "trees", tmp_path / "sources.tar.gz"
    assert sources.main(["fetch", str(dest), "--archive", str(archive)]) == 0
    for name, commit in TESTED_COMMITS.items():
        assert (dest / name / MARKERS[name]).read_text() == "v1\n"  # the tested commit, not the branch head
        assert (dest / name / COMMIT_FILE).read_text().strip() == commit
    # again: trees already at their commits are kept, nothing is fetched over them
    assert sources.main(["fetch", str(dest)]) == 0
    assert capsys.readouterr().out.count("already at") == 3
    unpacked = tmp_path / "unpacked"
    sources.unpack_archive(archive, unpacked)
    with tarfile.open(archive) as tar:
        assert not any(".git" in n.split("/") for n in tar.getnames())
    found = find_sources(*(str(unpacked / n) for n in ("MindSpeed-MM", "MindSpeed", "Megatron-LM")), env={})
    assert all(t.tested for t in found.trees())
    # a folder in the way is never overwritten
    (tmp_path / "busy" / "MindSpeed-MM").mkdir(parents=True)
    assert sources.main(["fetch", str(tmp_path / "busy")]) == 2
    assert "not overwriting" in capsys.readouterr().err


def test_fetch_without_a_reachable_repository_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys) -> None:
    monkeypatch.setenv("MSF_MINDSPEED_MM_URL", (tmp_path / "nowhere").as_uri())
    assert sources.main(["fetch", str(tmp_path / "trees")]) == 2
    err = capsys.readouterr().err
    assert "MindSpeed-MM at" in err and "no repository answered" in err and "nowhere" in err
