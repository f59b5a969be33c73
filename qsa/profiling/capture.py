"""Run a callable under one profiler and get KernelLaunch records back, raw trace kept on disk.

One profiler per process. On NVIDIA, starting Proton after torch.profiler has run in the same
process fails with "Failed to execute cuptiSubscribe with error 39" (a second CUPTI
subscriber); `capture_proton` refuses early with `ProfilerConflictError` instead. Run Proton
captures in a fresh process (a separate script or `subprocess`).

AMD import order: `triton.profiler` is imported at the top of this module because Proton's
rocprofiler backend (Triton >= 3.8) configures itself when libproton loads, and records nothing
(3.8.0 even deadlocks at exit) if torch initialised HSA first. Import `qsa.profiling` (or
`triton.profiler`) before `torch` in scripts that may use Proton on AMD; Proton also refuses to
start when HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES is set (use ROCR_VISIBLE_DEVICES). Do not
run Proton under rocprofv3.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from qsa.profiling.kineto import read_kineto_trace
from qsa.profiling.proton import read_proton_trace, read_proton_tree
from qsa.profiling.records import KernelAggregate, KernelLaunch
from qsa.profiling.rocprof import roctx_unavailable_reason

try:  # eager on purpose: see the AMD import-order note above
    import triton
    import triton.profiler as _proton

    _PROTON_IMPORT_ERROR: str | None = None
except ImportError as _e:
    _proton = None
    _PROTON_IMPORT_ERROR = f"triton.profiler is not importable ({_e})"

KINETO_TRACE_NAME = "kineto_trace.json"
PROTON_NAME = "proton"

# Set once torch.profiler has traced CUDA activity in this process (see module docstring).
_torch_profiler_ran_on_cuda = False
_CUPTI_CONFLICT = (
    "torch.profiler already ran in this process, and Proton would then fail with "
    "'cuptiSubscribe ... error 39' (one CUPTI subscriber per process); run Proton in a fresh process"
)


class ProfilerUnavailableError(RuntimeError):
    """The requested profiler cannot run in this process (no GPU, no CUPTI, disabled, ...)."""


class ProfilerConflictError(RuntimeError):
    """Another profiler already owns the device tracing hooks in this process."""


def capture_backend_available() -> dict[str, str | None]:
    """Which capture paths can run here: None means usable, a string says why not.

    Keys: "torch_profiler", "proton", "rocprofv3" (the CLI, for `rocprof.rocprofv3_command`)
    and "roctx" (markers for rocprofv3; without it the shims are no-ops).
    """
    try:
        backend = _gpu_backend("profiling")
    except ProfilerUnavailableError as e:
        gpu_reason: str | None = str(e)
        backend = None
    else:
        gpu_reason = None
    return {
        "torch_profiler": gpu_reason or _kineto_device_reason(),
        "proton": gpu_reason or _proton_reason(backend),
        "rocprofv3": _rocprofv3_reason(backend, gpu_reason),
        "roctx": roctx_unavailable_reason(),
    }


def capture_torch_profiler(
    fn: Callable[[], Any], steps: int, out_dir: str | Path, step_name: str = "step", *, warmup: int = 1
) -> list[KernelLaunch]:
    """Run `fn` `steps` times under torch.profiler; return its kernel launches.

    Each call runs inside `record_function(f"{step_name}{i}")`, which kineto mirrors on the
    device as a `gpu_user_annotation`, so every launch carries its step as `region`. `warmup`
    calls run before profiling so compilation and cold first launches stay out. The chrome
    trace is written to `out_dir/kineto_trace.json`.
    """
    global _torch_profiler_ran_on_cuda
    _check_steps(steps, warmup)
    backend = _gpu_backend("capture_torch_profiler")
    reason = _kineto_device_reason()
    if reason is not None:
        raise ProfilerUnavailableError(f"capture_torch_profiler: {reason}")
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if backend == "cuda":
        _torch_profiler_ran_on_cuda = True  # CUPTI is subscribed from here on, even if fn raises
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"{step_name}{i}"):
                fn()
        torch.cuda.synchronize()
    trace_path = out_dir / KINETO_TRACE_NAME
    prof.export_chrome_trace(str(trace_path))
    return read_kineto_trace(trace_path)


def capture_proton(
    fn: Callable[[], Any],
    steps: int,
    out_dir: str | Path,
    *,
    data: Literal["trace", "tree"] = "trace",
    step_name: str = "step",
    warmup: int = 1,
) -> list[KernelLaunch] | list[KernelAggregate]:
    """Run `fn` `steps` times under Proton; return launches (trace) or aggregates (tree).

    Each call runs inside `proton.scope(f"{step_name}{i}")`, which becomes the region. The
    output is `out_dir/proton.chrome_trace` or `out_dir/proton.hatchet`. Tree data keeps only
    count and total per kernel and scope; `warmup` calls before `proton.start` keep cold
    launches out of that total.
    """
    if data not in ("trace", "tree"):
        raise ValueError(f"data must be 'trace' or 'tree', got {data!r}")
    _check_steps(steps, warmup)
    backend = _gpu_backend("capture_proton")
    if backend == "cuda" and _torch_profiler_ran_on_cuda:
        raise ProfilerConflictError(f"capture_proton: {_CUPTI_CONFLICT}")
    reason = _proton_reason(backend)
    if reason is not None:
        raise ProfilerUnavailableError(f"capture_proton: {reason}")
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        session = _proton.start(str(out_dir / PROTON_NAME), data=data)
    except Exception as e:  # libproton reports CUPTI failures as plain runtime errors
        if "cuptiSubscribe" in str(e):
            raise ProfilerConflictError(
                f"capture_proton: {e}. Another CUPTI client (usually torch.profiler) ran in this "
                "process; run the Proton capture in a fresh process"
            ) from e
        raise
    if session is None:
        raise ProfilerUnavailableError(
            "capture_proton: proton.start returned no session (TRITON_PROTON_DISABLE is set or the "
            "script runs under the proton CLI)"
        )
    try:
        for i in range(steps):
            with _proton.scope(f"{step_name}{i}"):
                fn()
        torch.cuda.synchronize()
    finally:
        _proton.finalize(session)
    suffix = "chrome_trace" if data == "trace" else "hatchet"
    path = out_dir / f"{PROTON_NAME}.{suffix}"
    if not path.is_file():
        found = sorted(p.name for p in out_dir.iterdir())
        raise FileNotFoundError(f"capture_proton: Proton wrote no {path.name} in {out_dir} (found {found})")
    return read_proton_trace(path) if data == "trace" else read_proton_tree(path)


def _check_steps(steps: int, warmup: int) -> None:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def _gpu_backend(what: str) -> Literal["cuda", "hip"]:
    """"cuda" or "hip" for the visible GPU, else ProfilerUnavailableError naming `what`."""
    try:
        import torch
    except ImportError as e:
        raise ProfilerUnavailableError(f"{what} needs a GPU and torch, but torch is not importable ({e})") from e
    if not torch.cuda.is_available():
        raise ProfilerUnavailableError(
            f"{what} needs a GPU: torch.cuda.is_available() is False (torch {torch.__version__}); "
            "parse existing traces with the read_* functions instead"
        )
    return "hip" if torch.version.hip else "cuda"


def _kineto_device_reason() -> str | None:
    from torch.profiler import ProfilerActivity, supported_activities

    if ProfilerActivity.CUDA not in supported_activities():
        return "kineto has no device activity in this torch build (no CUPTI / roctracer), so no kernel events"
    return None


def _proton_reason(backend: str | None) -> str | None:
    if _PROTON_IMPORT_ERROR is not None:
        return _PROTON_IMPORT_ERROR
    if triton.knobs.proton.disable:
        return "TRITON_PROTON_DISABLE is set, so proton.start is a no-op"
    if backend == "cuda" and _torch_profiler_ran_on_cuda:
        return _CUPTI_CONFLICT
    if backend == "hip":
        for env in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            if env in os.environ:
                return f"Proton refuses to start on AMD while {env} is set; select GPUs with ROCR_VISIBLE_DEVICES"
    return None


def _rocprofv3_reason(backend: str | None, gpu_reason: str | None) -> str | None:
    if shutil.which("rocprofv3") is None:
        return "rocprofv3 is not on PATH (it ships with ROCm)"
    if gpu_reason is not None:
        return gpu_reason
    if backend != "hip":
        return "rocprofv3 profiles AMD GPUs only; this process sees a CUDA device"
    return None
