"""A newcomer's path to a MindSpeed-MM job on CPU: `emulate --setup DIR` and `emulate --print-command`.

    mindspeed-flow emulate --setup DIR [--sources-archive SOURCES.tar.gz | --fetch]
    source DIR/env.sh
    mindspeed-flow emulate --print-command --layout dp2       # prints the line below, ready to paste
    mindspeed-flow emulate --nproc 2 -- pretrain_vlm.py --use-mcore-models ... --mm-model DIR/tiny/model.json ...

`--setup` takes the sources from an archive (three folders, each with its `.source_commit`), from git at the
tested commits (`--fetch`), from the *_HOME variables, or from DIR/sources of an earlier run; checks their
commits; builds the tiny tokenizer/processor/images/configs under DIR/tiny; and writes DIR/env.sh. It never
overwrites a source tree or an env.sh it did not write.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

from omegaconf import OmegaConf

from mindspeed_flow.emulation import tiny
from mindspeed_flow.emulation.jobs import TinyJob
from mindspeed_flow.emulation.sources import (ENV_VARS, TESTED_COMMITS, SourceError, check_commits, fetch_tree,
                                              find_sources, unpack_archive, MARKERS)

ENV_HEADER = "# written by `mindspeed-flow emulate --setup`"
TINY_ENV = "MSF_TINY_WORKDIR"
# The tiny model has 2 ViT and 2 decoder layers, 2 ViT heads and 4 decoder heads: PP <= 2 and TP <= 2.
_LAYOUT_RE = re.compile(r"((?:dp|tp|pp)\d+)+(sp)?")
# What a flow job of the tiny model adds to the coupled line (the integration tests' job flags).
FLOW_JOB_FLAGS = ["--calculate-per-token-loss", "--variable-seq-lengths", "--sequence-parallel"]


def dependency_problem() -> str | None:
    """Why this interpreter cannot run MindSpeed-MM's training path (None when it can)."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "transformers is not installed"
    if not version.startswith("4.57."):
        return (f"MindSpeed-MM needs transformers 4.57.x (this interpreter has {version}); use a venv with the "
                "mindspeed-flow `emulate` extra (bash scripts/setup_emulate_env.sh builds .venv-emulate)")
    for dist in ("peft", "datasets", "pandarallel", "qwen_vl_utils"):
        try:
            metadata.version(dist.replace("_", "-"))
        except metadata.PackageNotFoundError:
            return f"MindSpeed-MM dependency {dist} is not installed (install the `emulate` extra)"
    return None


def _say(msg: str) -> None:
    print(f"mindspeed-flow emulate --setup: {msg}", flush=True)


def _sources_in(root: Path) -> bool:
    return all((root / name / marker).is_file() for name, marker in MARKERS.items())


def prepare_sources(workdir: Path, archive: str | None, fetch: bool) -> dict[str, Path]:
    """The three source roots, obtained as the docstring says; raises SourceError with what to do otherwise."""
    root = workdir / "sources"
    if archive:
        if _sources_in(root):
            _say(f"{root} already holds the three trees: using them, not unpacking {archive} over them")
        else:
            _say(f"unpacking {archive} into {root}")
            unpack_archive(Path(archive).expanduser().resolve(), root)
    elif fetch:
        for name in TESTED_COMMITS:
            if not (root / name / MARKERS[name]).is_file():
                _say(f"fetching {name} at {TESTED_COMMITS[name][:12]} into {root / name}")
                fetch_tree(name, root / name)
    elif all(os.environ.get(v) for v in ENV_VARS.values()):
        return {name: Path(os.environ[var]).expanduser().resolve() for name, var in ENV_VARS.items()}
    elif not _sources_in(root):
        raise SourceError(
            "no MindSpeed-MM sources: pass --sources-archive SOURCES.tar.gz (MindSpeed-MM/, MindSpeed/, Megatron-LM/ "
            "each with a .source_commit), or --fetch (git, network), or set " + ", ".join(ENV_VARS.values()) +
            " to existing checkouts. Tested commits: " + ", ".join(f"{k} {v[:10]}" for k, v in TESTED_COMMITS.items()))
    return {name: root / name for name in TESTED_COMMITS}


def write_env(path: Path, values: dict[str, str]) -> None:
    """DIR/env.sh; an existing one is replaced only if this command wrote it."""
    if path.exists() and not path.read_text().startswith(ENV_HEADER):
        raise SourceError(f"{path} exists and was not written by --setup: not overwriting it")
    body = [ENV_HEADER, "# source this file before `mindspeed-flow emulate ...`"]
    body += [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
    path.write_text("\n".join(body) + "\n")


def run_setup(workdir: str, archive: str | None = None, fetch: bool = False) -> int:
    root = Path(workdir).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        roots = prepare_sources(root, archive, fetch)
        sources = find_sources(str(roots["MindSpeed-MM"]), str(roots["MindSpeed"]), str(roots["Megatron-LM"]),
                               env={})
        for warning in check_commits(sources):
            _say(f"warning: {warning}")
        problem = dependency_problem()
        if problem:
            raise SourceError(f"sources ready in {roots['MindSpeed-MM'].parent}; not building the tiny assets: "
                              f"{problem}")
    except SourceError as err:
        print(f"mindspeed-flow emulate --setup: {err}", file=sys.stderr)
        return 2
    _say(f"building the tiny Qwen2.5-VL assets in {root / 'tiny'}")
    tiny.prepare_workdir(root / "tiny")
    tiny.write_configs(root / "tiny", [2, 0], [1, 1], name="model_pp2.json")
    env = {ENV_VARS[t.name]: str(t.root) for t in sources.trees()}
    env.update({TINY_ENV: str(root / "tiny"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    write_env(root / "env.sh", env)
    print(f"\nReady. Next:\n  source {root / 'env.sh'}\n  mindspeed-flow emulate --print-command --layout dp2\n"
          f"and run the line it prints (layouts: dp2, tp2sp, pp2, dp2pp2; add --flow-recipe "
          f"recipes/mindspeed_mm/tiny_enc1_dec_dp2.yaml for a flow job).", flush=True)
    return 0


def parse_layout(layout: str) -> tuple[int, int, int, bool]:
    """'dp2', 'tp2sp', 'pp2', 'dp2pp2' -> (dp, tp, pp, sequence_parallel)."""
    if not _LAYOUT_RE.fullmatch(layout):
        raise ValueError(f"--layout {layout!r}: write it as dp<N>, tp<N>, pp<N> joined (e.g. dp2pp2), optionally "
                         "ending in sp (tp2sp)")
    sizes = {"dp": 1, "tp": 1, "pp": 1}
    sizes.update({k: int(v) for k, v in re.findall(r"(dp|tp|pp)(\d+)", layout)})
    if sizes["tp"] > 2 or sizes["pp"] > 2 or min(sizes.values()) < 1:
        raise ValueError(f"--layout {layout!r}: the tiny model allows tp <= 2 and pp <= 2")
    sp = layout.endswith("sp")
    if sp and sizes["tp"] < 2:
        raise ValueError(f"--layout {layout!r}: sequence parallelism (sp) needs tp2")
    return sizes["dp"], sizes["tp"], sizes["pp"], sp


def tiny_command(tiny_dir: Path, layout: str, flow_recipe: str | None = None) -> list[str]:
    """`mindspeed-flow emulate ...` argv of a tiny job: coupled in `layout`, or the flow job of `flow_recipe`."""
    model = tiny_dir / "model.json"
    data = tiny_dir / "data.json"
    if not model.is_file() or not data.is_file():
        raise FileNotFoundError(f"{tiny_dir}: no model.json/data.json; run `mindspeed-flow emulate --setup DIR` "
                                f"first (then source DIR/env.sh, or pass --tiny DIR/tiny)")
    cmd = ["mindspeed-flow", "emulate"]
    if flow_recipe:
        recipe = Path(flow_recipe).expanduser().resolve()
        parts = OmegaConf.to_container(OmegaConf.load(str(recipe)).get("parallel", {}))
        nproc = sum(int(p.get("dp", 1)) * int(p.get("tp", 1)) * int(p.get("pp", 1)) * int(p.get("cp", 1))
                    for k, p in parts.items() if isinstance(p, dict))
        pp_text = int(parts.get("backbone", {}).get("pp", 1))
        model = tiny_dir / ("model_pp2.json" if pp_text > 1 else "model.json")
        job = TinyJob(model, data, global_batch_size=4, extra=list(FLOW_JOB_FLAGS))
        return cmd + ["--nproc", str(nproc), "--flow-recipe", str(recipe), "--"] + job.argv()
    dp, tp, pp, sp = parse_layout(layout)
    if pp > 1:
        model = tiny_dir / "model_pp2.json"
    job = TinyJob(model, data, tp=tp, pp=pp, sequence_parallel=sp, global_batch_size=2 * dp)
    return cmd + ["--nproc", str(dp * tp * pp), "--"] + job.argv()


def print_command(tiny_dir: str | None, layout: str, flow_recipe: str | None) -> int:
    where = tiny_dir or os.environ.get(TINY_ENV)
    if not where:
        print(f"mindspeed-flow emulate --print-command: pass --tiny DIR/tiny or set {TINY_ENV} (source the env.sh "
              "that `mindspeed-flow emulate --setup DIR` wrote)", file=sys.stderr)
        return 2
    try:
        print(shlex.join(tiny_command(Path(where).expanduser().resolve(), layout, flow_recipe)))
    except (ValueError, FileNotFoundError) as err:
        print(f"mindspeed-flow emulate --print-command: {err}", file=sys.stderr)
        return 2
    return 0
