"""`import mindspeed_flow` (and every non-emulation subpackage) never loads the emulation layer or a torch_npu.

On an Ascend machine the real torch_npu must be the only one ever imported; the fake lives in a folder that only
the explicit emulation entry points put on sys.path. Checked in a fresh interpreter, which then activates the
emulation as a control: the same check must see it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import mindspeed_flow, mindspeed_flow.cli

    def import_subpackages(pkg):
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if info.ispkg and not info.name.startswith("mindspeed_flow.emulation"):
                import_subpackages(importlib.import_module(info.name))

    def snapshot():
        bad = sorted(m for m in sys.modules if m.startswith("mindspeed_flow.emulation") or m.split(".")[0] in
                     ("torch_npu", "torchair"))
        on_path = [p for p in sys.path if p.rstrip("/").endswith("emulation/site")]
        loaded = sorted(m for m in sys.modules if m.startswith("mindspeed_flow."))
        return {"bad": bad, "on_path": on_path, "loaded": loaded}

    import_subpackages(mindspeed_flow)
    before = snapshot()
    from mindspeed_flow import emulation
    emulation.activate()  # the control: the same check must see an activated emulation
    print(json.dumps({"before": before, "after": snapshot()}))
""")


@pytest.fixture(scope="module", params=["strict", "lenient"])
def probe(request: pytest.FixtureRequest) -> dict:
    """The probe's snapshots; its control activation runs in each emulation mode."""
    env = dict(os.environ, MSF_EMULATION_MODE=request.param)
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_mindspeed_flow_never_loads_emulation_or_torch_npu(probe: dict) -> None:
    result = probe["before"]
    assert result["bad"] == [], f"importing mindspeed_flow loaded: {result['bad']}"
    assert result["on_path"] == []
    assert "mindspeed_flow.cli" in result["loaded"]


def test_control_activation_is_visible_to_the_check(probe: dict) -> None:
    result = probe["after"]
    assert "torch_npu" in result["bad"] and "mindspeed_flow.emulation" in result["bad"]
    assert len(result["on_path"]) == 1
