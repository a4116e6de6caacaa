"""The emulated npu's RNG in the device's layout (16 bytes: seed, Philox offset) as Megatron, MindSpeed and DTensor use
it, which layout each job gets, and triton's emulated NPU driver.

Activation patches torch for the whole process, so the activated checks run in child interpreters.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindspeed_flow.emulation import device

_DEVICE_RNG = textwrap.dedent("""
    import os
    import torch
    from mindspeed_flow import emulation
    assert emulation.activate(mode="strict") == "strict"
    import torch_npu  # noqa: F401

    torch.npu.manual_seed(7)
    state = torch.npu.get_rng_state()
    assert state.dtype == torch.uint8 and state.numel() == 16, state  # torch_npu's layout
    assert state.view(torch.int64).tolist() == [7, 0]
    a = torch.rand(4, device="npu")
    later = torch.npu.get_rng_state()  # after draws: the offset moved on
    assert later.view(torch.int64).tolist()[1] > 0
    b = torch.rand(4, device="npu")
    torch.npu.set_rng_state(later)
    assert torch.equal(torch.rand(4, device="npu"), b) and not torch.equal(a, b)

    # Megatron / MindSpeed restore the device RNG through the default generator (tensor_parallel/random.py
    # _set_cuda_rng_state): the same 16 bytes, also in the graph-safe form.
    gen = torch.npu.default_generators[0]
    gen.set_state(later)
    assert torch.equal(torch.rand(4, device="npu"), b)
    assert torch.equal(gen.get_state(), torch.npu.get_rng_state())
    snapshot = gen.graphsafe_get_state()
    c = torch.rand(4, device="npu")
    gen.graphsafe_set_state(snapshot)
    assert torch.equal(torch.rand(4, device="npu"), c)
    assert gen.manual_seed(7) is gen and gen.initial_seed() == 7
    for wrong in (torch.zeros(5, dtype=torch.uint8), torch.zeros(16, dtype=torch.float32)):
        try:
            gen.set_state(wrong)
        except RuntimeError:
            pass
        else:
            raise AssertionError(f"accepted a {wrong.numel()}-element {wrong.dtype} state")

    # DTensor's OffsetBasedRNGTracker reads the offset at byte 8 and writes its own (FSDP2 init on a mesh).
    import datetime, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard
    dist.init_process_group("hccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("npu", (1,))
    w = distribute_tensor(torch.empty(8, 4, device="npu"), mesh, [Shard(0)])
    w.normal_(std=0.02)  # the call transformers' init makes on a sharded weight
    assert w.full_tensor().std().item() > 0
    dist.destroy_process_group()
    print("DEVICE_RNG_OK", flush=True)
    # The checks are done: leave without the interpreter's teardown. On torch 2.7 its finalizers can still free the
    # mesh's gloo group after destroy_process_group and abort from gloo's threads ("terminate called without an
    # active exception", rc -6, after DEVICE_RNG_OK: seen twice in CI), which is not what this test is about.
    os._exit(0)
""")

_TRITON = textwrap.dedent("""
    import torch
    from mindspeed_flow import emulation
    assert emulation.activate(mode="strict") == "strict"
    import triton
    from triton.runtime import driver
    props = driver.active.utils.get_device_properties(torch.npu.current_device())
    assert props["num_aicore"] == 24 and props["num_vectorcore"] == 48, props
    assert driver.active.get_current_target().backend == "npu"

    @triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["n"])
    @triton.jit
    def kernel(x_ptr, n, BLOCK: "triton.language.constexpr"):
        pass
    from mindspeed_flow.emulation.triton_npu import KernelLaunchUnderEmulation
    try:
        driver.active.launcher_cls
    except KernelLaunchUnderEmulation as err:
        assert "do not run under mindspeed-flow emulate" in str(err)
    else:
        raise AssertionError("the emulated driver handed out a launcher")
    print("TRITON_OK")
""")


def _child(code: str, folder: Path, **env: str) -> subprocess.CompletedProcess:
    """Run `code` as a script file (triton.jit reads its kernel's source) with the emulation's site first."""
    script = folder / "child.py"
    script.write_text(code)
    site = os.path.join(os.path.dirname(device.__file__), "site")
    paths = [site, os.getcwd(), os.environ.get("PYTHONPATH", "")]
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **env})


def test_npu_rng_in_the_device_layout_serves_megatron_and_dtensor(tmp_path: Path) -> None:
    proc = _child(_DEVICE_RNG, tmp_path, MSF_EMULATE_RNG="device")
    assert proc.returncode == 0 and "DEVICE_RNG_OK" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-5000:])


def test_triton_driver_answers_npu_queries_and_refuses_kernels(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="triton is not installed (it comes with CUDA builds of torch)")
    proc = _child(_TRITON, tmp_path)
    assert proc.returncode == 0 and "TRITON_OK" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-5000:])


@pytest.mark.parametrize("environ, argv, expected", [
    ({}, ["pretrain_vlm.py", "--mm-model", "m.json"], False),  # the Megatron path keeps the CPU generator's state
    ({}, ["/src/pretrain_transformers.py", "cfg.yaml"], True),  # Megatron's loop over MindSpeed's torch FSDP2
    ({}, ["-m", "mindspeed_flow_patches.launch", "--flow-recipe", "f.yaml", "pretrain_transformers.py"], True),
    ({"NON_MEGATRON": "true"}, ["mindspeed_mm/fsdp/train/trainer.py", "cfg.yaml"], True),
    ({"MSF_EMULATE_RNG": "cpu", "NON_MEGATRON": "true"}, ["trainer.py"], False),
    ({"MSF_EMULATE_RNG": "device"}, ["pretrain_vlm.py"], True),
])
def test_which_jobs_get_the_device_layout(environ: dict[str, str], argv: list[str], expected: bool) -> None:
    assert device._uses_device_layout(environ, argv) is expected


def test_a_wrong_rng_choice_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="MSF_EMULATE_RNG='philox': expected 'device' or 'cpu'"):
        device._uses_device_layout({"MSF_EMULATE_RNG": "philox"}, [])
