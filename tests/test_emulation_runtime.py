"""The activated emulation in both modes (device mapping, backends, HCCL names, log) and the `emulate` command.

Activation patches torch for the whole process, so every activated check runs in a child interpreter; the
command-line checks use --dry-run against throwaway source trees and never launch a job.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from mindspeed_flow import emulation
from mindspeed_flow.emulation import cli, log as emu_log, modes, tiny
from mindspeed_flow.emulation.sources import TESTED_COMMITS

_LENIENT = textwrap.dedent("""
    import datetime, os, torch, torch.distributed as dist
    from mindspeed_flow import emulation
    assert emulation.activate() == "lenient"
    import torch_npu
    from torch_npu.contrib import transfer_to_npu  # noqa: F401 (already applied; must be idempotent)

    # devices: npu/cuda/int -> cpu; type() claims cuda; cuda answers from the emulated device
    assert str(torch.device("npu:1")) == "npu:1" and torch.npu.device_count() >= 1
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2).to("npu:0").device.type == "cpu" and torch.ones(2).to(0).device.type == "cpu"
    x = torch.empty(3, device=torch.device("cuda", 0)).cuda().npu()
    assert x.type() == "torch.cuda.FloatTensor", x.type()
    assert x.type("torch.cuda.HalfTensor").dtype == torch.float16
    m = torch.nn.Linear(2, 2).cuda().to("npu")
    assert next(m.parameters()).device.type == "cpu" and torch.cuda.is_available()
    torch.cuda.manual_seed(5); a = torch.rand(3)
    state = torch.cuda.get_rng_state(); b = torch.rand(3); torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3), b) and not torch.equal(a, b)
    with torch.npu.stream(torch.npu.Stream()):
        torch.npu.synchronize()
    import io
    buf = io.BytesIO(); torch.save({"w": torch.ones(2)}, buf)
    for loc in ("npu:0", {"cuda:0": "cpu"}, lambda s, _: s):
        buf.seek(0); assert torch.load(buf, map_location=loc)["w"].device.type == "cpu"

    # distributed: nccl -> gloo, hccl subgroup with HCCL options -> gloo, comm name -> that group
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30),
                            device_id=torch.device("npu", 0))
    assert dist.get_backend() == "gloo"
    opts = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options(); opts.hccl_config = {"hccl_buffer_size": 200}
    group = dist.new_group([0], backend="hccl", pg_options=opts)
    assert dist.get_backend(group) == "gloo"
    name = group._get_backend(torch.device("npu")).get_hccl_comm_name(0)
    out, gathered = torch_npu.npu_all_gather_base_mm(torch.ones(2, 3), torch.ones(3, 4), name, 1)
    assert torch.equal(out, torch.full((2, 4), 3.0))
    dist.barrier(device_ids=[0])
""")

_STRICT = textwrap.dedent("""
    import datetime, io, torch, torch.distributed as dist
    from mindspeed_flow import emulation
    assert emulation.activate() == "strict"
    import torch_npu
    from torch_npu.contrib import transfer_to_npu  # noqa: F401 (already applied; must be idempotent)

    # devices: cuda and int ids -> npu, a real device; type() names npu (MindSpeed maps it to cuda itself)
    assert str(torch.device("npu:1")) == "npu:1" and torch.npu.device_count() >= 1
    assert torch.zeros(2, device="cuda").device.type == "npu"
    assert torch.ones(2).to("cuda:0").device == torch.device("npu", 0) and torch.ones(2).to(0).device.type == "npu"
    x = torch.empty(3, device=torch.device("cuda", 0)).cuda().npu()
    assert x.type() == "torch.npu.FloatTensor" and x.is_npu and x.is_cuda and not torch.ones(1).is_npu, x.type()
    assert x.type("torch.npu.HalfTensor").dtype == torch.float16 and isinstance(x, torch.cuda.FloatTensor)
    m = torch.nn.Linear(2, 2).cuda().to("npu")
    assert next(m.parameters()).device.type == "npu" and torch.cuda.is_available()
    torch.cuda.manual_seed(5); a = torch.rand(3, device="cuda")
    state = torch.cuda.get_rng_state(); b = torch.rand(3, device="cuda"); torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda"), b) and not torch.equal(a, b)
    with torch.npu.stream(torch.npu.Stream()):
        torch.npu.synchronize()
    x.record_stream(torch.cuda.current_stream())
    from torch.utils.checkpoint import DefaultDeviceType
    assert DefaultDeviceType.get_device_type() == "npu"  # as torch_npu sets it for gradient checkpointing
    buf = io.BytesIO(); torch.save({"w": torch.ones(2, device="npu")}, buf)
    for loc, want in ((None, "npu"), ("npu:0", "npu"), ("cuda:0", "npu"), ({"cuda:0": "cpu"}, "cpu"),
                      ("cpu", "cpu"), (lambda s, _: s, "cpu")):
        buf.seek(0); w = torch.load(buf, map_location=loc)["w"]
        assert w.device.type == want and torch.equal(w.cpu(), torch.ones(2)), (loc, w.device)

    # distributed: nccl -> hccl (a backend for npu tensors), options accepted, comm name -> that group.
    # No device_id: the real transfer_to_npu leaves a cuda device_id as it is (a real NPU job would fail with it).
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    assert dist.get_backend() == "hccl"
    opts = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options(); opts.hccl_config = {"hccl_buffer_size": 200}
    group = dist.new_group([0], backend="hccl", pg_options=opts)
    assert dist.get_backend(group) == "hccl"
    name = group._get_backend(torch.device("npu")).get_hccl_comm_name(0)
    out, gathered = torch_npu.npu_all_gather_base_mm(torch.ones(2, 3, device="npu"), torch.ones(3, 4, device="npu"),
                                                     name, 1)
    assert out.device.type == "npu" and torch.equal(out.cpu(), torch.full((2, 4), 3.0))
    assert dist.get_backend(dist.new_group([0], backend="gloo")) == "gloo"
    dist.barrier(device_ids=[0])
""")

_COMMON = textwrap.dedent("""
    # missing names raise AttributeError and are logged; MindSpeed's patch-manager scans are not
    assert not hasattr(torch_npu, "npu_not_a_real_op")
    exec(compile("hasattr(torch_npu, 'scanned_name')", "/x/mindspeed/patch_utils.py", "exec"))
    import torch_npu.profiler as prof, torch_npu.utils.flops_count, torchair
    from torchair.ge import Tensor, TensorSpec, DataType
    p = prof.profile(activities=[prof.ProfilerActivity.NPU], experimental_config=prof._ExperimentalConfig(
        profiler_level=prof.ProfilerLevel.Level1), on_trace_ready=prof.tensorboard_trace_handler("/tmp", analyse_flag=False))
    dist.destroy_process_group()
    print("ACTIVATED-OK")
""")


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_activated_emulation_maps_devices_backends_and_logs(tmp_path: Path, mode: str) -> None:
    log_file = tmp_path / "emu.log"
    env = dict(**__import__("os").environ, **{emu_log.ENV_VAR: str(log_file), modes.ENV_VAR: mode})
    script = (_STRICT if mode == "strict" else _LENIENT) + _COMMON
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "ACTIVATED-OK" in proc.stdout, proc.stderr[-4000:]
    events = emu_log.read_log(str(log_file))
    assert {"torch_npu.contrib.transfer_to_npu", "torch_npu.npu_all_gather_base_mm"} <= events["CALLED"]
    assert "torch_npu.npu_not_a_real_op" in events["MISSING"]
    assert "torch_npu.scanned_name" not in events["MISSING"]
    assert "[msf-emulation rank=-] missing: torch_npu.npu_not_a_real_op" in proc.stderr


def test_activate_refuses_when_a_real_torch_npu_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with pytest.raises(RuntimeError, match="real torch_npu is already imported"):
        emulation.activate()
    assert emulation.site_dir() not in sys.path


# ------------------------------------------------------------------------------------ the emulate command
def _fake_tree(root: Path, marker: str, commit: str) -> Path:
    (root / marker).parent.mkdir(parents=True, exist_ok=True)
    (root / marker).write_text("")
    (root / ".source_commit").write_text(commit + "\n")
    return root


@pytest.fixture
def fake_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    trees = {
        "MINDSPEED_MM_HOME": _fake_tree(tmp_path / "mm", "mindspeed_mm/__init__.py", TESTED_COMMITS["MindSpeed-MM"]),
        "MINDSPEED_HOME": _fake_tree(tmp_path / "ms", "mindspeed/megatron_adaptor.py", TESTED_COMMITS["MindSpeed"]),
        "MEGATRON_HOME": _fake_tree(tmp_path / "mg", "megatron/core/package_info.py", TESTED_COMMITS["Megatron-LM"]),
    }
    (trees["MINDSPEED_MM_HOME"] / "pretrain_vlm.py").write_text("")
    for var, path in trees.items():
        monkeypatch.setenv(var, str(path))
    return trees


def test_emulate_without_sources_names_the_variables(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for var in ("MINDSPEED_MM_HOME", "MINDSPEED_HOME", "MEGATRON_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["--nproc", "2", "--", "pretrain_vlm.py"]) == 2
    err = capsys.readouterr().err
    assert "MINDSPEED_MM_HOME" in err and "MINDSPEED_HOME" in err and "MEGATRON_HOME" in err
    assert TESTED_COMMITS["MindSpeed-MM"][:10] in err


def test_emulate_dry_run_builds_path_and_torchrun_command(fake_sources: dict[str, Path], capsys) -> None:
    assert cli.main(["--nproc", "4", "--patches", "--dry-run", "--", "pretrain_vlm.py", "--bf16"]) == 0
    out = capsys.readouterr().out
    pythonpath = out.split("PYTHONPATH=")[1].splitlines()[0].split(":")
    assert pythonpath[0] == emulation.site_dir()
    assert pythonpath.index(str(fake_sources["MINDSPEED_HOME"])) < pythonpath.index(str(fake_sources["MEGATRON_HOME"]))
    assert "torch.distributed.run --nproc_per_node 4" in out
    assert "-m mindspeed_flow_patches.launch pretrain_vlm.py --bf16" in out


def test_emulate_runs_strict_unless_lenient(fake_sources: dict[str, Path], monkeypatch, capsys) -> None:
    monkeypatch.delenv(modes.ENV_VAR, raising=False)
    assert cli.main(["--dry-run", "--", "pretrain_vlm.py"]) == 0
    assert f"{modes.ENV_VAR}=strict" in capsys.readouterr().out
    assert cli.main(["--dry-run", "--lenient", "--", "pretrain_vlm.py"]) == 0
    assert f"{modes.ENV_VAR}=lenient" in capsys.readouterr().out
    monkeypatch.setenv(modes.ENV_VAR, "lenient")
    assert cli.main(["--dry-run", "--", "pretrain_vlm.py"]) == 0
    assert f"{modes.ENV_VAR}=lenient" in capsys.readouterr().out
    assert emulation.site_env({}, mode="strict")[modes.ENV_VAR] == "strict"
    with pytest.raises(ValueError, match="not one of strict, lenient"):
        modes.resolve("loose")


def test_emulate_rejects_untested_commits_unless_allowed(fake_sources: dict[str, Path], capsys) -> None:
    (fake_sources["MINDSPEED_HOME"] / ".source_commit").write_text("deadbeef" * 5)
    assert cli.main(["--dry-run", "--", "pretrain_vlm.py"]) == 2
    assert "untested source commits: MindSpeed at" in capsys.readouterr().err
    assert cli.main(["--dry-run", "--allow-untested", "--", "pretrain_vlm.py"]) == 0
    assert "running untested" in capsys.readouterr().err


def test_emulate_uses_megatron_copy_inside_mindspeed_mm(fake_sources, monkeypatch, capsys) -> None:
    monkeypatch.delenv("MEGATRON_HOME")
    (fake_sources["MINDSPEED_MM_HOME"] / "megatron/core").mkdir(parents=True)
    (fake_sources["MINDSPEED_MM_HOME"] / "megatron/core/package_info.py").write_text("")
    assert cli.main(["--dry-run", "--", "pretrain_vlm.py"]) == 0  # commit unknown: a warning, not an error
    captured = capsys.readouterr()
    assert "Megatron-LM" in captured.err and "commit unknown" in captured.err


def test_emulate_usage_errors(fake_sources, capsys) -> None:
    assert cli.main([]) == 2
    assert cli.main(["--", "no_such_script.py"]) == 2
    assert "not found" in capsys.readouterr().err


def test_job_env_is_offline_single_threaded_and_logs(fake_sources, tmp_path: Path) -> None:
    from mindspeed_flow.emulation.sources import find_sources

    env = cli.job_env(find_sources(), str(tmp_path / "l.log"), base={"PATH": "/usr/bin"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env[emu_log.ENV_VAR] == str(tmp_path / "l.log")
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)


# ------------------------------------------------------------------------------------ tiny assets
def test_tiny_tokenizer_puts_special_tokens_on_preset_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tiny.build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(tok) == 384
    assert tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>"]) == \
        [380, 381, 382, 383]
    ids = tok("a red circle on a blue background<|im_end|>")["input_ids"]
    assert ids[-1] == 383 and max(ids) < 384 and tok.decode(ids[:-1]) == "a red circle on a blue background"


def test_tiny_samples_and_configs(tmp_path: Path) -> None:
    import json

    samples = json.loads(tiny.write_samples(tmp_path / "data", 6).read_text())
    assert len(samples) == 6 and all(Path(s["images"][0]).is_file() for s in samples)
    assert samples[0]["messages"][0]["content"].startswith("<image>")
    model, data = tiny.write_configs(tmp_path, [2, 0], [1, 1], name="m.json")
    cfg = json.loads(model.read_text())
    assert cfg["text_decoder"]["pipeline_num_layers"] == [1, 1] and cfg["img_context_token_id"] == 380
    assert str(tmp_path / "processor") in data.read_text()
    with pytest.raises(ValueError, match="must sum to num_layers"):
        tiny.write_configs(tmp_path, [1, 0], None)


def test_emulate_shell_dry_run_runs_nothing(fake_sources: dict[str, Path], tmp_path: Path, capsys) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "launch.sh"
    script.write_text(f"# The flow twin of x.sh: the same job trained decoupled with r.yaml (4 ranks = encoder dp2 tp1 "
                      f"pp1 cp1, backbone dp1 tp2 pp1 cp1), 2 node(s) x 2.\ntouch {marker}\n")
    assert cli.main(["--dry-run", "--shell", str(script)]) == 0
    assert capsys.readouterr().out.endswith(f"bash {script}\n")
    assert cli.main(["--dry-run", "--nodes", "2", "--shell", str(script), "--log-dir", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "NODE_RANK=1 NNODES=2 NPUS_PER_NODE=2 MASTER_ADDR=localhost MASTER_PORT=" in out
    assert not marker.exists()
    assert cli.main(["--nodes", "3", "--shell", str(script)]) == 2
    assert "4 ranks, which 3 nodes cannot share evenly" in capsys.readouterr().err
    assert cli.main(["--nodes", "2", "--", "pretrain_vlm.py"]) == 2
    assert "--nodes rehearses a launch script" in capsys.readouterr().err
