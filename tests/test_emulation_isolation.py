"""`import mindspeed_flow` (and every non-emulation subpackage) never loads the emulation layer or a torch_npu.

On an Ascend machine the real torch_npu must be the only one ever imported; the fake lives in a folder that only
the explicit emulation entry points put on sys.path. Checked in a fresh interpreter, with a control run that
activates the emulation to show the check can see it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import mindspeed_flow, mindspeed_flow.cli

    def import_subpackages(pkg):
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if info.ispkg and not info.name.startswith("mindspeed_flow.emulation"):
                import_subpackages(importlib.import_module(info.name))

    import_subpackages(mindspeed_flow)
    if ACTIVATE:
        from mindspeed_flow import emulation
        emulation.activate()
    bad = sorted(m for m in sys.modules if m.startswith("mindspeed_flow.emulation") or m.split(".")[0] in
                 ("torch_npu", "torchair"))
    on_path = [p for p in sys.path if p.rstrip("/").endswith("emulation/site")]
    loaded = sorted(m for m in sys.modules if m.startswith("mindspeed_flow."))
    print(json.dumps({"bad": bad, "on_path": on_path, "loaded": loaded}))
""")


def _probe(activate: bool) -> dict:
    code = f"ACTIVATE = {activate}\n" + _PROBE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_mindspeed_flow_never_loads_emulation_or_torch_npu() -> None:
    result = _probe(activate=False)
    assert result["bad"] == [], f"importing mindspeed_flow loaded: {result['bad']}"
    assert result["on_path"] == []
    assert "mindspeed_flow.cli" in result["loaded"]


def test_control_activation_is_visible_to_the_check() -> None:
    result = _probe(activate=True)
    assert "torch_npu" in result["bad"] and "mindspeed_flow.emulation" in result["bad"]
    assert len(result["on_path"]) == 1
