"""`mindspeed-flow emulate`: run a MindSpeed-MM job on CPU with the emulated torch_npu.

    mindspeed-flow emulate [--nproc N] [--patches] [--flow-recipe FLOW.yaml] [--log FILE] [--lenient] -- pretrain_vlm.py <args...>
    mindspeed-flow emulate [--lenient] --shell SCRIPT.sh       a MindSpeed-MM launch script, unchanged
    mindspeed-flow emulate --shell SCRIPT.sh --nodes N [--nproc RANKS_PER_NODE] [--log-dir DIR]   N nodes rehearsed
    mindspeed-flow emulate --setup DIR [--sources-archive A.tar.gz | --fetch]   sources + tiny assets + env.sh
    mindspeed-flow emulate --print-command [--tiny DIR] [--layout dp2|tp2sp|pp2|dp2pp2] [--flow-recipe F.yaml]

The job runs unmodified under `torch.distributed.run` (`--distributed-backend nccl` becomes hccl over gloo), in the
MindSpeed-MM root so its relative paths resolve, with PYTHONPATH = fake packages, this repo, MindSpeed,
MindSpeed-MM (and Megatron-LM). Paths on the command line are the caller's: the script and every path flag
(`--mm-data`, `--mm-model`, `--load`, ...) that names a file or folder under the caller's folder are made absolute
before the job moves to MindSpeed-MM's root; those that exist only there (e.g. `--mm-tool mindspeed_mm/tools/
tools.json`) stay as they are, and output folders (`--save`, `--tensorboard-dir`) are always the caller's.
`--patches` runs the script through `mindspeed_flow_patches.launch`, which registers the mindspeed-flow patch set
first. The flags a CPU run needs (`--bf16`, `--no-gradient-accumulation-fusion`, `--variable-seq-lengths` with PP)
are in the line `--print-command` prints (`mindspeed_flow.emulation.jobs.TinyJob` builds it).

The emulated NPU is strict by default (a real npu device that refuses host tensors in device ops and in HCCL
collectives, see mindspeed_flow/emulation/README.md "Strict and lenient"); `--lenient` (or MSF_EMULATION_MODE=lenient) runs the job with npu
tensors as host CPU tensors instead. `--dry-run` prints what would run (the folder, PYTHONPATH, the mode and the
command, or `bash SCRIPT.sh` with --shell) and starts nothing.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mindspeed_flow.emulation import log as emu_log
from mindspeed_flow.emulation import modes, nodes, site_env
from mindspeed_flow.emulation.quickstart import print_command, run_setup
from mindspeed_flow.emulation.sources import SourceError, Sources, check_commits, find_sources
from mindspeed_flow.hosts.mindspeed_mm.entries import check_flow_entry
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError
from mindspeed_flow.utils import free_port, working_dir

PATCH_LAUNCHER = "mindspeed_flow_patches.launch"
# Megatron / MindSpeed-MM flags whose value is a path the job reads (resolved against the caller's folder when it
# exists there) and those it writes (always the caller's: a relative output folder must not land in the sources).
INPUT_PATH_FLAGS = ("--mm-data", "--mm-model", "--mm-tool", "--load", "--data-path", "--tokenizer-model",
                    "--tokenizer-name-or-path", "--pretrained-checkpoint")
OUTPUT_PATH_FLAGS = ("--save", "--tensorboard-dir", "--wandb-save-dir")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindspeed-flow emulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks on this host (torchrun --nproc_per_node; default 1); with --nodes: ranks per node "
                        "(default: the script's ranks / N)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: torchrun's)")
    p.add_argument("--mindspeed-mm-home", default=None, help="MindSpeed-MM root (else $MINDSPEED_MM_HOME)")
    p.add_argument("--mindspeed-home", default=None, help="MindSpeed root (else $MINDSPEED_HOME)")
    p.add_argument("--megatron-home", default=None,
                   help="Megatron-LM core_v0.12.1 root (else $MEGATRON_HOME, else MindSpeed-MM's megatron/ copy)")
    p.add_argument("--patches", action="store_true", help=f"run through {PATCH_LAUNCHER} (mindspeed-flow patches)")
    p.add_argument("--flow-recipe", default=None,
                   help="train decoupled with this flow recipe (implies --patches; checked before launch)")
    p.add_argument("--log", default=None, help=f"emulation log file (sets {emu_log.ENV_VAR})")
    p.add_argument("--lenient", action="store_true",
                   help=f"lenient emulation: npu tensors are host CPU tensors (default: ${modes.ENV_VAR}, else strict)")
    p.add_argument("--allow-untested", action="store_true", help="run sources at commits other than the tested ones")
    p.add_argument("--dry-run", action="store_true",
                   help="print the command (or --shell script) and its environment; run and write nothing")
    p.add_argument("--shell", default=None, metavar="SCRIPT.sh",
                   help="run a MindSpeed-MM launch script (torchrun inside) in the emulated environment instead")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="with --shell: rehearse a multi-node launch: the script once per node rank, all at once "
                        "(NODE_RANK=i, NNODES=N, MASTER_ADDR=localhost, a free MASTER_PORT, NPUS_PER_NODE)")
    p.add_argument("--log-dir", default=None, help="with --nodes: each node's output as node<i>.out (default: a "
                                                   "new temporary folder)")
    p.add_argument("--setup", default=None, metavar="DIR",
                   help="prepare DIR: the pinned sources (from --sources-archive, --fetch, or the *_HOME variables), "
                        "the tiny model/data assets and DIR/env.sh; then print the next commands")
    p.add_argument("--sources-archive", default=None, metavar="A.tar.gz",
                   help="with --setup: unpack the three source trees from this archive")
    p.add_argument("--fetch", action="store_true", help="with --setup: git-fetch the sources at the tested commits")
    p.add_argument("--print-command", action="store_true",
                   help="print a working `mindspeed-flow emulate` line for a tiny Qwen2.5-VL job, run nothing")
    p.add_argument("--tiny", default=None, metavar="DIR",
                   help="with --print-command: the tiny assets folder (default: $MSF_TINY_WORKDIR)")
    p.add_argument("--layout", default="dp2", help="with --print-command: dp<N>, tp<N>[sp], pp2 or combined, "
                                                   "e.g. dp2pp2 (default dp2)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- pretrain_vlm.py <args...>")
    return p


def job_env(sources: Sources, log_path: str | None, base: dict[str, str] | None = None,
            mode: str | None = None) -> dict[str, str]:
    """The environment of an emulated job (fake packages and sources on PYTHONPATH, offline, one thread); `mode`
    pins the emulation mode (else the base environment's MSF_EMULATION_MODE, else strict)."""
    env = site_env(base, mode)
    parts = env["PYTHONPATH"].split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts[:2] + sources.pythonpath() + parts[2:]))
    # Megatron's dataset helper is built with `make`, which runs `python3 -m pybind11`: this interpreter first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    if log_path:
        env[emu_log.ENV_VAR] = str(Path(log_path).resolve())
    return env


def job_command(nproc: int, script_argv: list[str], patches: bool, master_port: int | None = None,
                flow_recipe: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1"]
    if master_port:
        cmd += ["--master_port", str(master_port)]
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    if patches or flow_recipe:
        cmd += ["-m", PATCH_LAUNCHER]
    if flow_recipe:
        cmd += ["--flow-recipe", str(Path(flow_recipe).resolve())]
    return cmd + script_argv


def resolve_caller_paths(script_argv: list[str], cwd: Path | None = None) -> list[str]:
    """The job's arguments with the caller's relative paths made absolute (the job itself runs in MindSpeed-MM's
    root)."""
    cwd = Path.cwd() if cwd is None else cwd
    out = list(script_argv)

    def fix(value: str, output: bool) -> str:
        path = Path(value).expanduser()
        if path.is_absolute() or not (output or (cwd / path).exists()):
            return value  # absolute, or a path of MindSpeed-MM's own tree (or wrong, and the job says so)
        return str((cwd / path).resolve())

    if out and out[0].endswith(".py"):
        script = Path(out[0]).expanduser()
        if not script.is_absolute() and (cwd / script).is_file():
            out[0] = str((cwd / script).resolve())
    # MindSpeed-MM's YAML entries (`pretrain_transformers.py CONFIG.yaml`, `mindspeed_mm/fsdp/train/trainer.py
    # CONFIG.yaml`) take their config as the first argument; relative to the job's folder it would not be found
    # (MindSpeed-MM then fails with an UnboundLocalError, not a missing file).
    if len(out) > 1 and not out[1].startswith("-") and out[1].endswith((".yaml", ".yml")):
        out[1] = fix(out[1], False)
    for i in range(1, len(out)):
        flag = out[i - 1]
        if flag in INPUT_PATH_FLAGS or flag in OUTPUT_PATH_FLAGS:
            out[i] = fix(out[i], flag in OUTPUT_PATH_FLAGS)
        elif "=" in out[i] and out[i].split("=", 1)[0] in INPUT_PATH_FLAGS + OUTPUT_PATH_FLAGS:
            key, value = out[i].split("=", 1)
            out[i] = f"{key}={fix(value, key in OUTPUT_PATH_FLAGS)}"
    return out


def _mode(args: argparse.Namespace) -> str | None:
    return modes.LENIENT if args.lenient else None


def _run_shell(args: argparse.Namespace) -> int:
    """A user's launch script, unchanged, with the emulated torch_npu and the sources on its path (cwd: MindSpeed-MM)."""
    try:
        sources = find_sources(args.mindspeed_mm_home, args.mindspeed_home, args.megatron_home)
        check_commits(sources, args.allow_untested)
    except SourceError as err:
        print(f"mindspeed-flow emulate: {err}", file=sys.stderr)
        return 2
    shell = Path(args.shell).resolve()
    if not shell.is_file():
        print(f"mindspeed-flow emulate: --shell {args.shell}: no such file", file=sys.stderr)
        return 2
    env = job_env(sources, args.log, mode=_mode(args))
    if args.nodes:
        return _run_nodes(args, shell, sources, env)
    cmd = ["bash", str(shell)]
    if args.dry_run:
        return _print_dry_run(sources.mindspeed_mm.root, env, cmd)
    return subprocess.run(cmd, cwd=str(sources.mindspeed_mm.root), env=env).returncode


def _run_nodes(args: argparse.Namespace, shell: Path, sources: Sources, env: dict[str, str]) -> int:
    """The launch script as --nodes nodes on this machine (see `mindspeed_flow.emulation.nodes`)."""
    try:
        per_node = nodes.ranks_per_node(shell, args.nodes, args.nproc)
    except nodes.NodesError as err:
        print(f"mindspeed-flow emulate: {err}", file=sys.stderr)
        return 2
    if args.log_dir:
        log_dir = Path(args.log_dir).resolve()
    else:  # a dry run creates nothing, not even the folder it names
        log_dir = Path("<new temporary folder>") if args.dry_run else Path(tempfile.mkdtemp(prefix="msf-nodes-"))
    # a twin written without a log file of the user's writes FLOW_LOG_DIR/train_<date>_node<i>.log: here, not in
    # the MindSpeed-MM sources
    env.setdefault("FLOW_LOG_DIR", str(log_dir))
    port = free_port()
    if args.dry_run:
        _print_dry_run(sources.mindspeed_mm.root, env, [])
        for i in range(args.nodes):
            print(f"NODE_RANK={i} NNODES={args.nodes} NPUS_PER_NODE={per_node} MASTER_ADDR=localhost "
                  f"MASTER_PORT={port} bash {shell} > {log_dir / f'node{i}.out'} 2>&1 &")
        return 0
    print(f"mindspeed-flow emulate: {args.nodes} nodes x {per_node} ranks of {shell.name} on this machine "
          f"(rendezvous localhost:{port}; outputs in {log_dir})", flush=True)
    results, failed = nodes.run_nodes(shell, args.nodes, per_node, env, sources.mindspeed_mm.root, log_dir, port)
    rc, line = nodes.report(results, failed)
    print(f"mindspeed-flow emulate: {line}", file=sys.stderr if rc else sys.stdout, flush=True)
    return rc


def _print_dry_run(root: Path, env: dict[str, str], cmd: list[str]) -> int:
    """--dry-run: what would run, where and with which emulation environment; nothing is started."""
    mode = env.get(modes.ENV_VAR, modes.STRICT)
    print(f"cd {root}\nPYTHONPATH={env['PYTHONPATH']}\n{modes.ENV_VAR}={mode}\n" + " ".join(cmd))
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    script = list(args.script)
    if script[:1] == ["--"]:
        script = script[1:]
    if args.setup:
        if args.dry_run:
            print(f"would prepare {args.setup}: the pinned sources, the tiny assets and env.sh (--dry-run: nothing "
                  "written)")
            return 0
        return run_setup(args.setup, archive=args.sources_archive, fetch=args.fetch)
    if args.print_command:
        return print_command(args.tiny, args.layout, args.flow_recipe)
    if args.shell:
        return _run_shell(args)
    if args.nodes:
        print("mindspeed-flow emulate: --nodes rehearses a launch script: give it with --shell SCRIPT.sh",
              file=sys.stderr)
        return 2
    args.nproc = args.nproc or 1
    if not script:
        print("mindspeed-flow emulate: give the job after '--', e.g. -- pretrain_vlm.py --mm-model ...",
              file=sys.stderr)
        return 2
    try:
        sources = find_sources(args.mindspeed_mm_home, args.mindspeed_home, args.megatron_home)
        for warning in check_commits(sources, args.allow_untested):
            print(f"mindspeed-flow emulate: warning: {warning}", file=sys.stderr)
    except SourceError as err:
        print(f"mindspeed-flow emulate: {err}", file=sys.stderr)
        return 2
    script = resolve_caller_paths(script)
    if not (sources.mindspeed_mm.root / script[0]).is_file():  # an absolute script[0] replaces the root
        print(f"mindspeed-flow emulate: script {script[0]!r} not found in {Path.cwd()} nor in "
              f"{sources.mindspeed_mm.root}", file=sys.stderr)
        return 2
    if args.flow_recipe:
        # The same check every rank repeats at start-up, once here so a wrong recipe is one message, not one per
        # rank plus the launcher's traceback.
        try:
            with working_dir(sources.mindspeed_mm.root):
                check_flow_entry(args.flow_recipe, script[0], script[1:], args.nproc)
        except FlowRecipeError as err:
            print(f"mindspeed-flow emulate: {err}", file=sys.stderr)
            return 2
    env = job_env(sources, args.log, mode=_mode(args))
    cmd = job_command(args.nproc, script, args.patches, args.master_port, args.flow_recipe)
    if args.dry_run:
        return _print_dry_run(sources.mindspeed_mm.root, env, cmd)
    return subprocess.run(cmd, cwd=str(sources.mindspeed_mm.root), env=env).returncode
