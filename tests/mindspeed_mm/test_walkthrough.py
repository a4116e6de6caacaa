"""The emulator README's walkthrough, run as written in a fresh clone: from nothing to a trained tiny MindSpeed-MM
job on CPU with the commands the README lists.

The README's block (after `<!-- walkthrough -->` in mindspeed_flow/emulation/README.md) is executed line by line in
`bash` inside a `git clone` of this repository, with $HOME in a temporary folder. The first two lines (build
`.venv-emulate`, activate it) are not run here: they take minutes and gigabytes, so the test runs in the
interpreter that script built, which must have MindSpeed-MM's dependencies (else it is skipped). Sources: `--fetch` is run as written where the upstream repositories answer; offline, with MINDSPEED_MM_HOME,
MINDSPEED_HOME and MEGATRON_HOME set, `--setup` takes them (the README's third way); else the test is skipped.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.emulation.jobs import parse_iterations
from mindspeed_flow.emulation.quickstart import dependency_problem
from mindspeed_flow.emulation.sources import ENV_VARS, REPO_URLS, repo_urls

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(3600)]
REPO = Path(__file__).resolve().parents[2]
README = REPO / "mindspeed_flow/emulation/README.md"


def walkthrough() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- walkthrough -->\n```bash\n(.*?)```", text, re.S)
    assert block, f"{README} lost its walkthrough block"
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


def _network() -> bool:
    def answers(url: str) -> bool:
        try:
            return subprocess.run(["git", "ls-remote", "--exit-code", url, "HEAD"], capture_output=True,
                                  timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    return all(any(answers(url) for url in repo_urls(name)) for name in REPO_URLS)


def test_readme_walkthrough_trains_a_tiny_job(tmp_path: Path) -> None:
    problem = dependency_problem()
    if problem:
        pytest.skip(f"run from the venv scripts/setup_emulate_env.sh builds: {problem}")
    lines = walkthrough()
    assert lines[0] == "bash scripts/setup_emulate_env.sh" and lines[1].startswith("source .venv-emulate/bin/activate")
    assert any("--setup" in ln and "--fetch" in ln for ln in lines)
    have_trees = all(os.environ.get(v) for v in ENV_VARS.values())
    if have_trees:
        lines = [ln.replace(" --fetch", "") for ln in lines]  # --setup takes the *_HOME trees
    elif not _network():
        pytest.skip("neither the upstream repositories (git) nor MINDSPEED_MM_HOME/MINDSPEED_HOME/MEGATRON_HOME")
    clone, home = tmp_path / "clone", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MSF_TINY_WORKDIR")}
    env["HOME"] = str(home)
    # the clone's code in the interpreter setup_emulate_env.sh built, `mindspeed-flow` as its console script
    env["PYTHONPATH"] = str(clone)
    prologue = [f"mindspeed-flow() {{ {shlex.quote(sys.executable)} -m mindspeed_flow.cli \"$@\"; }}"]
    script = "\n".join(["set -euo pipefail", *prologue, *lines[2:]]) + "\n"
    proc = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=3300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert (home / "msf-emu/env.sh").is_file() and (home / "msf-emu/tiny/model.json").is_file()
    printed = [ln for ln in proc.stdout.splitlines() if ln.startswith("mindspeed-flow emulate --nproc 2 -- ")]
    assert printed, output[-3000:]  # the --print-command line itself
    iterations, losses, _ = parse_iterations(output)
    assert iterations == [1, 2, 3], output[-4000:]
    assert all(loss == loss and loss < 100 for loss in losses), losses
