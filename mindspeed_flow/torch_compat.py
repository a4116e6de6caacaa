"""The one place that knows how torch releases differ (2.7.1, what MindSpeed-MM and torch_npu pin, vs the current
release in scripts/constraints.txt), in the spirit of hosts/torch/hf_compat.py for transformers.

Everything else asks this module instead of branching on torch itself:

- API names that moved: FSDP2's `fully_shard` / `FSDPModule`, DTensor, `DeviceMesh.from_group`, the keyword
  arguments a pipelining schedule accepts (`scale_grads`, `step(return_outputs=...)`), the all-gather /
  reduce-scatter names (`*_single` on new releases, `*_tensor` / `*_into_tensor` on 2.7);
- behaviour that differs without any error, measured once where it is used:
  * `reduce_scatter_avg_averages(group)`: does a reduce-scatter with ReduceOp.AVG average on this group? gloo in
    torch 2.7.1 silently SUMS, and FSDP2 reduce-scatters fp32/bf16 gradients with AVG, so its "averaged"
    gradients come out dp times too large there. `fsdp_grad_reduction(group, dtype, device)` measures what FSDP2
    itself then yields (mean or sum) and `data_parallel.dp_loss_scale` scales the loss to match, so the
    gradients are the same on every release (the project's own collectives only ever use SUM and divide);
  * `ensure_pipeline_p2p_waits_all()`: torch 2.7's pipelining schedules wait on only the LAST handle of each
    `batch_isend_irecv` batch, which is enough where the backend coalesces a batch into one work (NCCL) but not
    on gloo, where 1F1B's fused send+recv batches then never complete; where the installed schedules do that,
    their batch helper is replaced by one whose handle waits on every op;
  * `destroy_process_groups()`: torch 2.7's gloo can deadlock when a group is destroyed right after async
    collectives whose tensors Python already dropped; groups are destroyed here in a way that cannot;
  * `install_privateuse1_accelerator(...)`: torch 2.9+ lets Python register PrivateUse1 hooks, which the
    emulated torch_npu needs because `dist.barrier` asks `torch._C._get_accelerator()` once PrivateUse1 is
    renamed to "npu"; torch 2.7 has no such registration, so its accelerator queries are answered in Python.

Checks look at signatures, return values and results, never at version strings, so a release that mixes the
two styles still gets the right path. Each adaptation to an older torch is recorded once (`adaptations()`), and
the trainer prints them at start-up in one line (`startup_line()`): never a silent difference in results.
"""
from __future__ import annotations

import dataclasses

import functools
import inspect
import logging
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

log = logging.getLogger(__name__)

try:  # public from torch 2.5; 2.7 has both names
    from torch.distributed.tensor import DTensor, Replicate  # version: torch
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate  # type: ignore[no-redef]

try:  # FSDP2: public in torch.distributed.fsdp from 2.6, under _composable.fsdp before
    from torch.distributed.fsdp import FSDPModule, fully_shard  # version: torch
except ImportError:  # pragma: no cover - torch < 2.6
    from torch.distributed._composable.fsdp import FSDPModule, fully_shard  # type: ignore[no-redef]

__all__ = ["DTensor", "Replicate", "FSDPModule", "fully_shard", "device_mesh_for", "dist_fn", "accepts",
           "schedule_kwargs", "step_kwargs", "ensure_pipeline_p2p_waits_all", "prepare_pipelining",
           "reduce_scatter_avg_averages", "fsdp_grad_reduction", "destroy_process_groups",
           "install_privateuse1_accelerator", "adaptations", "startup_line", "shutdown_grace"]

# key -> one short phrase; insertion-ordered, each recorded once per process.
_ADAPTATIONS: dict[str, str] = {}


def _adapt(key: str, text: str) -> None:
    if key not in _ADAPTATIONS:
        _ADAPTATIONS[key] = text
        log.info("torch %s: %s", torch.__version__, text)


def adaptations() -> list[str]:
    """What this process does differently because the installed torch lacks something (empty on a current torch)."""
    return list(_ADAPTATIONS.values())


def startup_line() -> Optional[str]:
    """One line naming every adaptation made so far, for the trainer's start-up output; None when there is none."""
    if not _ADAPTATIONS:
        return None
    return f"[mindspeed-flow] torch {torch.__version__}: " + "; ".join(_ADAPTATIONS.values())


# ---------------------------------------------------------------- names and signatures
@functools.lru_cache(maxsize=None)
def accepts(fn: Callable, name: str) -> bool:
    """Whether `fn` takes a parameter called `name` (how a newer keyword is detected)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def dist_fn(*names: str) -> Callable[..., Any]:
    """The first of `names` that torch.distributed defines (list the newer name first: no deprecation warning)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch {torch.__version__}: torch.distributed has none of {names}")


def device_mesh_for(group: Optional[dist.ProcessGroup], device_type: str):
    """A 1-D DeviceMesh over `group` (DeviceMesh.from_group; init_device_mesh for the world group as fallback)."""
    group = group if group is not None else dist.group.WORLD
    if hasattr(DeviceMesh, "from_group"):
        return DeviceMesh.from_group(group, device_type=device_type)
    if dist.get_world_size(group) != dist.get_world_size():  # pragma: no cover - torch without from_group
        raise RuntimeError("this torch has no DeviceMesh.from_group; FSDP2 over a sub-group needs torch >= 2.4")
    return init_device_mesh(device_type, (dist.get_world_size(),))  # pragma: no cover


# ---------------------------------------------------------------- pipelining
def schedule_kwargs(cls: type) -> dict[str, Any]:
    """Constructor keywords for a schedule class: the runtime normalises the loss itself, so gradients must not be
    scaled by the microbatch count (`scale_grads=False`; releases without the flag never scale)."""
    return {"scale_grads": False} if accepts(cls.__init__, "scale_grads") else {}


def step_kwargs(schedule: Any) -> dict[str, Any]:
    """Keywords for `schedule.step` (a schedule or its class): skip merging the last stage's outputs where the
    release allows it."""
    cls = schedule if isinstance(schedule, type) else type(schedule)
    if accepts(cls.step, "return_outputs"):
        return {"return_outputs": False}
    _adapt("return_outputs", "pipelining step() has no return_outputs=, so the last stage also keeps the merged "
                             "logits of the step (memory only)")
    return {}


class _AllWorks:
    """One handle over every work of a `batch_isend_irecv` batch: waiting on it waits on each of them."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        for w in self._works:
            w.wait(*args, **kwargs)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def _batch_p2p_waiting_all(p2p_ops: list, desc: Optional[str] = None) -> Optional[_AllWorks]:
    if len(p2p_ops) == 0:
        return None  # the callers test the result for None/falsy exactly as with the original helper
    return _AllWorks(dist.batch_isend_irecv(p2p_ops))


_batch_p2p_waiting_all._msf_waits_all = True  # type: ignore[attr-defined]


def ensure_pipeline_p2p_waits_all() -> bool:
    """Make the installed pipelining schedules wait on every p2p op they start; returns True if that needed a fix.

    Current releases' batch helper returns the list of works and the schedules wait on each (`_batch_p2p([])` is a
    list); torch 2.7's returns only the last work (None for an empty batch) and the schedules wait on that alone.
    With gloo every op has its own work, so the others are never waited on and 1F1B deadlocks: there the helper is
    replaced, process-wide, by one returning a handle that waits on all (the same contract, nothing else changes).
    """
    try:
        from torch.distributed.pipelining import schedules  # optional: pipelining
    except ImportError:  # pragma: no cover - torch without pipelining
        return False
    current = getattr(schedules, "_batch_p2p", None)
    if current is None:  # pragma: no cover - a release that reorganised the helpers: nothing known to fix
        return False
    if getattr(current, "_msf_waits_all", False):
        return True
    if isinstance(current([]), list):
        return False
    schedules._batch_p2p = _batch_p2p_waiting_all
    _adapt("p2p", "pipelining schedules wait on one handle per batch_isend_irecv batch, so the pipeline's p2p "
                  "waits on every op's handle")
    return True


def prepare_pipelining() -> None:
    """Check (and record) everything the pipeline takes from the installed torch before its first step, so the
    start-up line names it: the p2p waits and the step keywords."""
    ensure_pipeline_p2p_waits_all()
    from torch.distributed.pipelining import Schedule1F1B  # optional: pipelining

    step_kwargs(Schedule1F1B)


# ---------------------------------------------------------------- reductions measured per group
# Results by (group, ...): keyed on the group object itself (hashable, and kept alive by the cache, so its id is
# never reused by another group while the answer is held).
_RS_AVG: dict[tuple[Any, str], bool] = {}
_FSDP_REDUCTION: dict[tuple[Any, torch.dtype, str], str] = {}


def _group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def reduce_scatter_avg_averages(group: Optional[dist.ProcessGroup] = None,
                                device: torch.device | str = "cpu") -> bool:
    """Whether reduce-scatter with ReduceOp.AVG averages over `group` (True) or not (False: it sums, or the backend
    refuses AVG); measured once per group.

    Collective: every rank of `group` must call it (the first time) in the same order as its other collectives.
    Rank r contributes r + 1 to every element, so the mean is (n + 1) / 2 and the sum n (n + 1) / 2; anything
    else raises.
    """
    g = _group(group)
    device = torch.device(device)
    key = (g, device.type)
    if key not in _RS_AVG:
        n = dist.get_world_size(g)
        if n == 1:
            _RS_AVG[key] = True  # nothing to reduce: both readings agree
            return True
        value = float(dist.get_rank(g) + 1)
        out = torch.empty(1, dtype=torch.float32, device=device)
        try:
            dist_fn("reduce_scatter_single", "reduce_scatter_tensor")(
                out, torch.full((n,), value, dtype=torch.float32, device=device), op=dist.ReduceOp.AVG, group=g)
        except (RuntimeError, ValueError, NotImplementedError) as err:
            # Every rank of the group has the same backend and refuses alike. A backend without AVG (or whose
            # torch build patches FSDP2 around it) is not an error here: fsdp_grad_reduction then measures FSDP2.
            log.info("reduce-scatter with ReduceOp.AVG unsupported on %s: %s", dist.get_backend(g), err)
            _RS_AVG[key] = False
            return False
        got, mean, total = float(out.item()), (n + 1) / 2, n * (n + 1) / 2
        if math.isclose(got, mean, rel_tol=1e-6):
            _RS_AVG[key] = True
        elif math.isclose(got, total, rel_tol=1e-6):
            _RS_AVG[key] = False
            _adapt("rs_avg", f"{dist.get_backend(g)} reduce-scatter with ReduceOp.AVG sums (probe: {got:g}, mean "
                             f"{mean:g})")
        else:
            raise RuntimeError(f"reduce-scatter with ReduceOp.AVG over {n} ranks gave {got}, neither the mean "
                               f"{mean} nor the sum {total}: this backend's AVG cannot be used for gradients")
    return _RS_AVG[key]


def fsdp_grad_reduction(group: Optional[dist.ProcessGroup], dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> str:
    """What FSDP2 makes of the DP ranks' gradients on `group` for parameters of `dtype`: "mean" or "sum".

    Collective over `group` (call it where `fully_shard` is called, on every rank). Where reduce-scatter with AVG
    averages, every FSDP2 path averages (AVG, or SUM with pre/post division for fp16). Where it does not (or the
    backend refuses AVG), FSDP2 is measured end to end: a one-parameter module is sharded over `group`, rank r
    back-propagates r + 1 into every element, and the gradient shard says which reduction happened.
    """
    g = _group(group)
    device = torch.device(device)
    key = (g, dtype, device.type)
    if key in _FSDP_REDUCTION:
        return _FSDP_REDUCTION[key]
    n = dist.get_world_size(g)
    if n == 1 or reduce_scatter_avg_averages(g, device):
        _FSDP_REDUCTION[key] = "mean"
        return "mean"
    probe = nn.Linear(1, n, bias=False, device=device, dtype=dtype)  # weight [n, 1]: one row per rank's shard
    fully_shard(probe, mesh=device_mesh_for(g, device.type))
    # through forward, so FSDP2's own hooks gather the weight and reduce-scatter its gradient
    (probe(torch.ones(1, 1, device=device, dtype=dtype)).sum() * float(dist.get_rank(g) + 1)).backward()
    got = float(probe.weight.grad.to_local().float().reshape(-1)[0])
    mean, total = (n + 1) / 2, n * (n + 1) / 2
    if math.isclose(got, mean, rel_tol=1e-3):
        result = "mean"
    elif math.isclose(got, total, rel_tol=1e-3):
        result = "sum"
        _adapt("fsdp", "FSDP2 gradients arrive summed over the DP group, not averaged, so the loss is not scaled by "
                       "the DP size (same gradients)")
    else:
        raise RuntimeError(f"FSDP2 over {n} ranks reduced the probe gradients to {got}, neither the mean {mean} "
                           f"nor the sum {total}")
    _FSDP_REDUCTION[key] = result
    return result


# ---------------------------------------------------------------- teardown
# Backends of destroyed process groups, held until the process exits (see destroy_process_groups).
_RETIRED_BACKENDS: list[Any] = []


def destroy_process_groups() -> None:
    """`dist.destroy_process_group()` that never joins a gloo thread while holding the GIL.

    torch 2.7's gloo releases a finished async work (the last C++ reference to its tensors) on its worker thread
    some time after the caller's `wait()` returned. If Python dropped those tensors in between, torch 2.7 has
    handed their Python objects over to the C++ tensors, so that release needs the GIL. Destroying the group
    joins those threads from the ProcessGroup's destructor, which runs with the GIL held: a deadlock at the end
    of a job (about one 3-rank run in 15 on 2 busy cores). The Python handle of a gloo *backend* destroys it
    with the GIL released, so a handle on every backend is taken first and kept until the process exits: the
    groups' destructors then only drop a reference, and no join ever waits on a thread that waits for the GIL.
    The current torch does not deadlock here; the same path runs on both. Idempotent.
    """
    if not dist.is_initialized():
        return
    seen = {id(b) for b in _RETIRED_BACKENDS}
    for pg in list(dist.distributed_c10d._world.pg_map):
        for device in getattr(pg, "_device_types", [torch.device("cpu")]):
            try:
                backend = pg._get_backend(device)
            except RuntimeError:  # no backend for this device type
                continue
            if id(backend) not in seen:
                seen.add(id(backend))
                _RETIRED_BACKENDS.append(backend)
    # The probes' answers are keyed on group objects: drop them with the groups.
    _RS_AVG.clear()
    _FSDP_REDUCTION.clear()
    dist.destroy_process_group()


# ---------------------------------------------------------------- PrivateUse1 (the emulated "npu")
def install_privateuse1_accelerator(device_module: Any) -> str:
    """Make torch's accelerator queries work for a PrivateUse1 backend with no real device behind it (the
    emulated torch_npu, whose "npu" tensors live on the CPU); call after `rename_privateuse1_backend`.

    torch 2.9+: register Python hooks saying no such device is available, and a device guard; torch then answers
    `_get_accelerator()` with the CPU, as `dist.barrier` needs. torch 2.7 offers no Python registration (torch_npu
    registers its hooks in C++), so the queries that would fail (`_get_accelerator`, the `torch.accelerator`
    device count / index / synchronize) are answered in Python with those same facts, from `device_module` (the
    emulated torch.npu). Returns "hooks" or "python".
    """
    acc = getattr(torch._C, "_acc", None)
    if acc is not None and hasattr(acc, "register_python_privateuseone_hook"):
        class _Hooks(acc.PrivateUse1Hooks):
            """No real device exists, so torch never dispatches kernels to "npu"."""

            def is_available(self) -> bool:
                return False

            def has_primary_context(self, dev_id: int) -> bool:
                return False

            def is_built(self) -> bool:
                return False

        class _Guard(acc.DeviceGuard):
            def type_(self) -> Any:
                return torch._C._autograd.DeviceType.PrivateUse1

        acc.register_python_privateuseone_hook(_Hooks())
        acc.register_python_privateuseone_device_guard(_Guard())
        return "hooks"
    try:
        torch._C._get_accelerator()
        return "python"  # torch answers already (no hooks needed): nothing to replace
    except RuntimeError:
        pass  # "Please register PrivateUse1HooksInterface ... first"
    answers: dict[str, Callable[..., Any]] = {
        "_get_accelerator": lambda: torch.device("cpu"),  # no usable accelerator device: what 2.9+ answers
        "_accelerator_deviceCount": lambda: int(device_module.device_count()),
        "_accelerator_getDeviceIndex": lambda: int(device_module.current_device()),
        "_accelerator_setDeviceIndex": lambda index: device_module.set_device(index),
        "_accelerator_synchronizeDevice": lambda index=None: device_module.synchronize(),
    }
    replaced = [name for name in answers if hasattr(torch._C, name)]
    for name in replaced:
        setattr(torch._C, name, answers[name])
    _adapt("privateuse1", "no Python PrivateUse1 hook registration, so the emulated npu answers torch's "
                          f"accelerator queries in Python ({', '.join(replaced)})")
    return "python"


# ---------------------------------------------------------------- the launcher's grace period
def shutdown_grace(seconds: int) -> dict[str, Any]:
    """LaunchConfig keywords that give the workers `seconds` between the agent's SIGTERM and its SIGKILL. Newer
    torch takes `shutdown_timeout`; older releases (2.7) close the workers with `PContext.close`'s default of 30 s,
    so that default is set to `seconds` here instead (the launcher process only)."""
    from torch.distributed.launcher.api import LaunchConfig  # lazy: launcher only

    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {"shutdown_timeout": int(seconds)}
    from torch.distributed.elastic.multiprocessing.api import PContext  # lazy: launcher only

    sig = inspect.signature(PContext.close)
    if "timeout" in sig.parameters and seconds != sig.parameters["timeout"].default:
        names = list(sig.parameters)[1:]  # the defaults cover the parameters after self, in order
        PContext.close.__defaults__ = tuple(int(seconds) if n == "timeout" else sig.parameters[n].default
                                            for n in names)
        _adapt("shutdown_grace", f"no LaunchConfig.shutdown_timeout: PContext.close waits {seconds} s by default")
    return {}
