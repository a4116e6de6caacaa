"""`mindspeed-flow doctor [--json]`: what this machine offers a flow job, and what it lacks.

Prints the versions a bug report needs (python, torch, torch_npu, CANN, MindSpeed, MindSpeed-MM and Megatron-LM
with their commits, transformers, ortools, hydra), the device the runtime would pick (type, count, name, backend,
MC2, peak FLOPs), and one line per missing piece with what it is needed for. torch_npu is imported only where
`mindspeed_flow.accelerator` would import it itself; MindSpeed, MindSpeed-MM and Megatron-LM never are (their
versions come from the installed distribution, their commits from git or a `.source_commit` file).

CANN is found under $ASCEND_TOOLKIT_HOME, else $ASCEND_HOME_PATH, else /usr/local/Ascend/ascend-toolkit/latest;
the source trees under $MINDSPEED_HOME, $MINDSPEED_MM_HOME and $MEGATRON_HOME when they are not importable.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

from mindspeed_flow import __version__
from mindspeed_flow.accelerator import Accelerator

NOT_INSTALLED = "not installed"
NOT_FOUND = "not found"
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"
# distribution name(s) per package, first found wins
DISTS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",), "torch_npu": ("torch_npu", "torch-npu"), "transformers": ("transformers",),
    "ortools": ("ortools",), "hydra": ("hydra-core",), "omegaconf": ("omegaconf",),
}
# (module, environment variable of a source checkout, distribution names)
SOURCES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "MindSpeed": ("mindspeed", "MINDSPEED_HOME", ("mindspeed",)),
    "MindSpeed-MM": ("mindspeed_mm", "MINDSPEED_MM_HOME", ("mindspeed_mm", "mindspeed-mm")),
    "Megatron-LM": ("megatron", "MEGATRON_HOME", ("megatron_core", "megatron-core")),
}
NEEDED_FOR: dict[str, str] = {
    "torch_npu": "training on Ascend NPUs (the build that matches CANN)",
    "CANN": "Ascend NPUs (source CANN's set_env.sh)",
    "MindSpeed": "flow-patched MindSpeed-MM jobs (`launch-script --job mm`, `emulate`): set MINDSPEED_HOME",
    "MindSpeed-MM": "flow-patched MindSpeed-MM jobs (`launch-script --job mm`, `emulate`): set MINDSPEED_MM_HOME",
    "Megatron-LM": "flow-patched MindSpeed-MM jobs: set MEGATRON_HOME (or install megatron-core)",
    "transformers": "`train` (the model modules)", "ortools": "`plan` (the allocator)",
    "hydra": "`train` (the recipe tree)",
}


def dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def cann_version(env: dict[str, str] | None = None) -> str:
    """CANN's version from the toolkit's version files, with the folder it came from; NOT_FOUND otherwise."""
    env = dict(os.environ if env is None else env)
    roots = [env.get("ASCEND_TOOLKIT_HOME"), env.get("ASCEND_HOME_PATH"), CANN_DEFAULT]
    for root in (Path(r) for r in roots if r):
        if not root.is_dir():
            continue
        files = [root / "version.cfg", *sorted(root.glob("*/ascend_toolkit_install.info")),
                 root / "compiler" / "version.info", root / "version.info"]
        for f in files:
            if not f.is_file():
                continue
            m = re.search(r"(?im)^\s*(?:toolkit_installed_version|version)\s*=\s*\[?([^\]:\s]+)", f.read_text())
            if m:
                return f"{m.group(1)} ({f})"
        return f"unknown version ({root} has no version file)"
    return NOT_FOUND


def source_version(module: str, env_var: str, dists: tuple[str, ...], env: dict[str, str] | None = None) -> str:
    """Installed version and commit of an importable package, else the commit of $env_var's checkout."""
    from mindspeed_flow.emulation.sources import SourceError, read_commit  # lazy: emulation

    def commit(root: Path) -> str:
        try:
            found = read_commit(root)
        except SourceError as err:
            return f"commit unreadable: {err}"
        return f"commit {found[:12]}" if found else "commit unknown"

    env = dict(os.environ if env is None else env)
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.origin:
        root = Path(spec.origin).resolve().parents[1]
        version = dist_version(dists) or "version unknown"
        return f"{version}, {commit(root)} ({root})"
    home = env.get(env_var)
    if home:
        root = Path(home).expanduser()
        if not root.is_dir():
            return f"{NOT_FOUND} ({env_var}={home} is not a folder)"
        return f"{commit(root)} ({env_var}={root})"
    return f"{NOT_FOUND} (not importable, {env_var} unset)"


def versions(env: dict[str, str] | None = None) -> dict[str, str]:
    out = {"python": platform.python_version(), "mindspeed-flow": _own_version()}
    for name, dists in DISTS.items():
        out[name] = dist_version(dists) or NOT_INSTALLED
    out["CANN"] = cann_version(env)
    for name, (module, env_var, dists) in SOURCES.items():
        out[name] = source_version(module, env_var, dists, env)
    return out


def _own_version() -> str:
    return __version__


def devices() -> dict[str, object]:
    acc = Accelerator.detect()
    info = acc.describe()
    info["device_count"] = acc.module.device_count() if acc.module is not None else os.cpu_count()
    for key in ("torch", "python"):
        info.pop(key, None)
    return info


def missing(found: dict[str, str]) -> list[str]:
    return [f"{name}: {NEEDED_FOR[name]}" for name in NEEDED_FOR
            if found.get(name, "").startswith((NOT_INSTALLED, NOT_FOUND))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mindspeed-flow doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the text report")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    found = versions()
    report = {"versions": found, "devices": devices(), "missing": missing(found)}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    width = max(map(len, found)) + 1
    print("versions")
    for name, value in found.items():
        print(f"  {name + ':':<{width}} {value}")
    print("devices")
    dev = report["devices"]
    for key in ("device_type", "device_count", "device_name", "backend", "capabilities", "varlen_attention_kernel",
                "peak_tflops"):
        print(f"  {key}: {dev.get(key)}")
    print("missing" + ("" if report["missing"] else ": nothing"))
    for line in report["missing"]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
