"""`after_import`: a hook runs once, right after a module is first imported, whoever imports it."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from mindspeed_flow.utils.import_hooks import after_import


def test_hook_runs_once_after_the_first_import(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "msf_hooked_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def hook(module) -> None:
        seen.append(module.VALUE)  # the module has run when the hook sees it
        module.VALUE = 2

    after_import("msf_hooked_module", hook)
    after_import("msf_hooked_module", hook)  # a start-up file run twice installs one hook
    try:
        assert importlib.import_module("msf_hooked_module").VALUE == 2
        del sys.modules["msf_hooked_module"]
        assert importlib.import_module("msf_hooked_module").VALUE == 1  # the hook left after its import
        assert seen == [1]
    finally:
        sys.modules.pop("msf_hooked_module", None)


def test_nothing_when_the_module_is_already_imported() -> None:
    calls = []
    importlib.import_module("json")
    after_import("json", calls.append)
    importlib.import_module("json")
    assert calls == []
