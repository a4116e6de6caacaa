"""Every flow patch target is a real function with the parameters its wrapper relies on, at the pinned commits.

With the MindSpeed-MM / MindSpeed / Megatron-LM sources (MINDSPEED_MM_HOME, MINDSPEED_HOME, MEGATRON_HOME, or the
pinned archive unpacked by scripts/run_mindspeed_mm_tests.sh; transformers' targets in the installed release) the check
reads the source files themselves
(`ast`, nothing is imported); without them it reads the signature manifest kept beside the repository
(`../shared/reference/mindspeed_api.json`), and skips with the reason when neither is there.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO.parent / "shared" / "reference" / "mindspeed_api.json"


def _registry():
    spec = importlib.util.spec_from_file_location("_flow_patches", REPO / "patches" / "flow.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    from mindspeed_flow_patches import fsdp2_flow  # the FSDP2 trainer's patch set
    from mindspeed_flow_patches import transformers_flow  # pretrain_transformers.py's (shares Megatron's targets)

    seen = {t.target for t in mod.REGISTRY + fsdp2_flow.REGISTRY}
    return mod.REGISTRY + fsdp2_flow.REGISTRY + tuple(t for t in transformers_flow.REGISTRY if t.target not in seen)


REGISTRY = _registry()
# Also run by scripts/run_mindspeed_mm_tests.sh, against the real sources.
pytestmark = pytest.mark.mindspeed_mm


def _source_roots() -> list[Path] | None:
    from mindspeed_flow.emulation.sources import SourceError, find_sources

    try:
        roots = [Path(p) for p in find_sources().pythonpath()]
    except SourceError:
        return None
    # GLM-4.5V's model class is transformers' own: the installed release (MindSpeed-MM's pin in its venv).
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.origin:
        roots.append(Path(spec.origin).parents[1])
    return roots


def _params_from_source(roots: list[Path], target: str) -> list[str] | None:
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        rel = Path(*parts[:split])
        for root in roots:
            for path in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
                if path.is_file():
                    node: ast.AST = ast.parse(path.read_text())
                    for name in parts[split:]:
                        node = next((n for n in ast.iter_child_nodes(node) if isinstance(
                            n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.name == name), None)
                        if node is None:
                            break
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        return [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
                    if node is None and split == len(parts) - 1:
                        # A module-level name the module imports (the wrapper replaces the module's binding):
                        # the signature of where it comes from, or [] when that is outside the sources (torch).
                        source = _imported_from(path, parts[-1])
                        if source is not None:
                            return (_params_from_source(roots, source) if source else None) or []
    return None


def _imported_from(path: Path, name: str) -> str | None:
    """`package.module.original_name` of `name` when the module at `path` binds it with `from ... import`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return f"{node.module}.{alias.name}"
        if isinstance(node, ast.Import):  # `import package.module as name`: a module, no signature
            if any(alias.asname == name for alias in node.names):
                return ""
    return None


def _params_from_manifest(target: str) -> list[str] | None:
    modules = json.loads(MANIFEST.read_text())["modules"]
    module, name = target.rsplit(".", 1)
    entry = modules.get(module, {}).get("functions", {}).get(name)
    if entry is None:
        return None
    sig = entry["signature"].strip("()")
    return [p.split("=")[0].strip().lstrip("*") for p in sig.split(",") if p.strip() and p.strip() != "*"]


@pytest.mark.parametrize("target", REGISTRY, ids=lambda t: t.target)
def test_patch_target_exists_with_compatible_signature(target) -> None:
    roots = _source_roots()
    if roots is not None:
        params, where = _params_from_source(roots, target.target), "the pinned sources"
    elif MANIFEST.is_file():
        params, where = _params_from_manifest(target.target), str(MANIFEST.name)
    else:
        pytest.skip("neither MindSpeed-MM sources (MINDSPEED_MM_HOME, ...) nor the signature manifest are present")
    if params is None and roots is None:
        pytest.skip(f"{target.target} is not in {where} (the sources check it: scripts/run_mindspeed_mm_tests.sh)")
    assert params is not None, f"{target.target} not found in {where}"
    assert params[:len(target.parameters)] == list(target.parameters), (target.target, params)
    assert target.why
