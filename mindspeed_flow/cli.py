"""`mindspeed-flow` command line: one entry, each subcommand implemented in the package that owns it.

    mindspeed-flow train [hydra overrides...]      decoupled (or coupled) training, local workers via torchrun
    mindspeed-flow plan [cluster=.. model=..]      heterogeneous parallel allocator (OR-Tools)
    mindspeed-flow profile [...]                   measure step times of a few layouts on the devices at hand
    mindspeed-flow bench packing|planner|...       benchmarks that print side-by-side numbers
    mindspeed-flow emulate [--nproc N] -- pretrain_vlm.py ...   run a MindSpeed-MM job on CPU (emulated NPU)
    mindspeed-flow emulate --nodes N --shell SCRIPT.sh          a launch script rehearsed as N nodes on this machine
    mindspeed-flow convert-checkpoint --to decoupled|coupled ...   coupled MindSpeed-MM checkpoint <-> flow parts
    mindspeed-flow doctor                          what this machine offers (device, backend, MC2, versions)
    mindspeed-flow launch-script RECIPE.yaml [--cluster a2|a3] [--job mm|train] [--out F.sh]   Ascend launch script
    mindspeed-flow launch-script RECIPE.yaml --from YOUR_SCRIPT.sh [--out F.sh]   the flow twin of your script
    mindspeed-flow report RUN_DIR                  PNG curves and one step's timeline of a run
    mindspeed-flow --version                       the package version

`mindspeed-flow COMMAND --help` prints a command's own usage.

Subcommand modules are imported only when used, so `plan` never imports torch.distributed machinery and
`emulate` never loads the emulation layer into another command's process.
"""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, str] = {
    "train": "mindspeed_flow.runtime.launch",
    "plan": "mindspeed_flow.planner.cli",
    "profile": "mindspeed_flow.planner.profile",
    "emulate": "mindspeed_flow.emulation.cli",
    "convert-checkpoint": "mindspeed_flow.emulation.convert_command",
    "doctor": "mindspeed_flow.doctor",
    "launch-script": "mindspeed_flow.runtime.launch_script",
    "report": "mindspeed_flow.runtime.report",
}
BENCHMARKS: dict[str, str] = {
    "packing": "mindspeed_flow.bench.packing",
    "planner": "mindspeed_flow.bench.planner",
    "simulator": "mindspeed_flow.bench.simulator",
    "pool": "mindspeed_flow.bench.pool",
    "train": "mindspeed_flow.bench.train",
    "overlap": "mindspeed_flow.bench.overlap",
    "checkpoint": "mindspeed_flow.bench.checkpoint",
    "attention": "mindspeed_flow.bench.attention",
    "build": "mindspeed_flow.bench.build",
    "device": "mindspeed_flow.bench.device",
    "msmm": "mindspeed_flow.bench.msmm",
    "memory": "mindspeed_flow.bench.memory",
}


def _usage() -> str:
    return (__doc__ or "").strip() + "\n\nbenchmarks: " + ", ".join(sorted(BENCHMARKS)) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from mindspeed_flow import __version__  # startup

        print(f"mindspeed-flow {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        bench_usage = f"usage: mindspeed-flow bench {{{'|'.join(sorted(BENCHMARKS))}}} [options]"
        if rest and rest[0] in ("-h", "--help"):
            print(bench_usage)
            return 0
        if not rest or rest[0] not in BENCHMARKS:
            print(bench_usage, file=sys.stderr)
            return 2
        module, rest = BENCHMARKS[rest[0]], rest[1:]
    elif cmd in SUBCOMMANDS:
        module = SUBCOMMANDS[cmd]
    else:
        from mindspeed_flow.utils.usage import unknown_key  # startup

        print(f"mindspeed-flow: {unknown_key(cmd, [*SUBCOMMANDS, 'bench'], 'command')}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
