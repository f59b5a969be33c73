"""A model of the device a number was measured on, and its measured ceilings.

Why: every result is filed under the device that produced it, FP8 formats are chosen by the
device (spec section 4), cold-cache rotation needs the last-level cache size, and roofline
fractions need measured (not datasheet) bandwidth and matrix rates.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from qsa.measure.files import atomic_write_bytes
from qsa.measure.timing import Timing, time_fn

MiB = 1 << 20
GiB = 1 << 30


class UnknownArchError(ValueError):
    """An architecture this module has no facts for; raised instead of guessing."""


class NoFp8Error(ValueError):
    """A known architecture without FP8 E4M3 support."""


@dataclass(frozen=True)
class _AmdArch:
    fp8_dtype: torch.dtype | None
    llc_bytes: int | None  # None: the L2 the driver reports is the last-level cache


# Facts per AMD arch (ROCm GPU specifications; Triton's AMD backend). MI300X/MI355X have a 256 MB Infinity Cache (MALL)
# in front of HBM that the driver does not report; CDNA1/2 have no MALL and no FP8.
_AMD_ARCHS: dict[str, _AmdArch] = {
    "gfx908": _AmdArch(None, None),
    "gfx90a": _AmdArch(None, None),
    "gfx940": _AmdArch(torch.float8_e4m3fnuz, 256 * MiB),
    "gfx941": _AmdArch(torch.float8_e4m3fnuz, 256 * MiB),
    "gfx942": _AmdArch(torch.float8_e4m3fnuz, 256 * MiB),
    "gfx950": _AmdArch(torch.float8_e4m3fn, 256 * MiB),
}


@dataclass(frozen=True)
class Datasheet:
    """A GPU's vendor figures: what a measured ceiling is checked against (a copy kernel
    reaching 30-100% of the datasheet bandwidth), never what a fraction is taken of. None: a
    figure not recorded here."""

    hbm_gbps: float
    llc_bytes: int | None = None
    compute_units: int | None = None  # SMs on NVIDIA, CUs on AMD
    bf16_tflops: float | None = None  # dense
    fp8_tflops: float | None = None  # dense


MB = 1000 * 1000  # vendors give cache sizes in MB
# Per device slug (`device_slug`). NVIDIA: the H200 and H100 Tensor Core GPU datasheets (SXM
# form factor; dense rates are half the "with sparsity" figures) and the Hopper
# architecture whitepaper (132 SMs and 50 MB L2 on both SXM parts). AMD: the Instinct
# MI355X/MI300X data sheets (HBM bandwidth and 256 MB Infinity Cache).
DATASHEETS: dict[str, Datasheet] = {
    "nvidia-h200": Datasheet(4800.0, 50 * MB, 132, 989.4, 1978.9),
    "nvidia-h100-80gb-hbm3": Datasheet(3350.0, 50 * MB, 132, 989.4, 1978.9),  # H100 SXM5
    "amd-mi355x": Datasheet(8000.0, 256 * MB),
    "amd-mi300x": Datasheet(5300.0, 256 * MB),
}


def parse_arch(*, gcn_arch_name: str | None = None,
               capability: tuple[int, int] | None = None) -> str:
    """Short arch name: ROCm "gfx950:sramecc+:xnack-" -> "gfx950"; CUDA (9, 0) -> "sm90"."""
    if (gcn_arch_name is None) == (capability is None):
        raise ValueError("give exactly one of gcn_arch_name (ROCm) or capability (CUDA)")
    if capability is not None:
        major, minor = capability
        if major < 1 or not 0 <= minor <= 9:
            raise ValueError(f"not a CUDA compute capability: {capability}")
        return f"sm{major}{minor}"
    m = re.fullmatch(r"(gfx[0-9a-f]+)(:[a-z0-9_-]+[+-])*", gcn_arch_name.strip())
    if m is None:
        raise ValueError(f"not a ROCm gcnArchName: {gcn_arch_name!r}")
    return m.group(1)


def fp8_flavour_for_arch(arch: str) -> tuple[torch.dtype, float]:
    """The FP8 E4M3 dtype the arch computes natively, and its finite max (448 or 240)."""
    if arch == "cpu":
        dtype = torch.float8_e4m3fn  # no hardware: the OCP format of both target GPUs
    elif m := re.fullmatch(r"sm(\d+)", arch):
        if int(m.group(1)) < 89:
            raise NoFp8Error(f"{arch} has no FP8 E4M3 support (needs sm89 or newer)")
        dtype = torch.float8_e4m3fn
    elif arch in _AMD_ARCHS:
        dtype = _AMD_ARCHS[arch].fp8_dtype
        if dtype is None:
            raise NoFp8Error(f"{arch} has no FP8 E4M3 support")
    else:
        raise UnknownArchError(f"no FP8 facts for arch {arch!r}; known AMD archs: "
                               f"{sorted(_AMD_ARCHS)}, NVIDIA sm<NN>, cpu")
    return dtype, float(torch.finfo(dtype).max)


def device_slug(vendor: str, name: str, arch: str) -> str:
    """Directory name for a device: vendor plus the product name without vendor words."""
    if vendor == "cpu":
        return "cpu-interpreter"
    words = [w.lower() for w in re.findall(r"[A-Za-z0-9]+", name)
             if w.lower() not in ("nvidia", "amd", "instinct")]
    return "-".join([vendor, *(words or [arch])])


@dataclass(frozen=True)
class DeviceInfo:
    """What a result depends on about the device and its software stack."""

    vendor: str  # "nvidia" | "amd" | "cpu"
    name: str
    arch: str  # "sm90", "gfx950", "gfx942", "cpu"
    unit_count: int  # SMs or CUs
    memory_bytes: int
    llc_bytes: int  # last-level cache: L2 on NVIDIA, Infinity Cache on MI300/MI355
    fp8_dtype: torch.dtype | None  # None: the device has no FP8
    fp8_max: float | None
    warp_size: int
    backend: str  # "cuda" | "hip" | "interpreter"
    driver_version: str
    runtime_version: str
    torch_version: str
    triton_version: str

    @property
    def slug(self) -> str:
        return device_slug(self.vendor, self.name, self.arch)

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    def as_record(self) -> dict[str, Any]:
        """JSON-ready dict (dtype as its name) with the slug."""
        rec = dataclasses.asdict(self)
        rec["fp8_dtype"] = str(self.fp8_dtype).removeprefix("torch.") if self.fp8_dtype else None
        rec["slug"] = self.slug
        return rec


def cpu_device() -> DeviceInfo:
    """The device model without a GPU: kernels run under the Triton interpreter."""
    dtype, fmax = fp8_flavour_for_arch("cpu")
    return DeviceInfo(vendor="cpu", name="cpu", arch="cpu", unit_count=os.cpu_count() or 1,
                      memory_bytes=0, llc_bytes=0, fp8_dtype=dtype, fp8_max=fmax, warp_size=1,
                      backend="interpreter", driver_version="none", runtime_version="none",
                      torch_version=torch.__version__, triton_version=triton.__version__)


def detect_device(index: int = 0) -> DeviceInfo:
    """Describe GPU `index` (ROCm exposes HIP as torch.cuda), or the CPU when there is none."""
    if not torch.cuda.is_available():
        return cpu_device()
    props = torch.cuda.get_device_properties(index)
    hip = torch.version.hip is not None
    if hip:
        vendor, backend = "amd", "hip"
        arch = parse_arch(gcn_arch_name=props.gcnArchName)
        if arch not in _AMD_ARCHS:
            raise UnknownArchError(f"no cache facts for AMD arch {arch!r}; add it to _AMD_ARCHS")
        llc = _AMD_ARCHS[arch].llc_bytes or props.L2_cache_size
        runtime = f"hip {torch.version.hip}"
    else:
        vendor, backend = "nvidia", "cuda"
        arch = parse_arch(capability=(props.major, props.minor))
        llc = props.L2_cache_size
        runtime = f"cuda {torch.version.cuda}"
    try:
        fp8_dtype, fp8_max = fp8_flavour_for_arch(arch)
    except NoFp8Error:
        fp8_dtype, fp8_max = None, None
    warp = getattr(props, "warp_size", None) or _default_warp_size(arch)
    return DeviceInfo(vendor=vendor, name=props.name, arch=arch,
                      unit_count=props.multi_processor_count, memory_bytes=props.total_memory,
                      llc_bytes=int(llc), fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                      warp_size=int(warp), backend=backend,
                      driver_version=_driver_version(vendor), runtime_version=runtime,
                      torch_version=torch.__version__, triton_version=triton.__version__)


def _default_warp_size(arch: str) -> int:
    """Wave64 on CDNA (gfx9), 32 elsewhere; the rule Triton's HIP backend uses."""
    m = re.fullmatch(r"gfx(\d+)[0-9a-f]{2}", arch)
    return 64 if m and int(m.group(1)) < 10 else 32


def _driver_version(vendor: str) -> str:
    """Kernel driver version where the OS shows it, else the driver API version."""
    try:
        if vendor == "nvidia":
            text = Path("/proc/driver/nvidia/version").read_text()
            if m := re.search(r"Kernel Module\s+([0-9.]+)", text):
                return m.group(1)
        else:
            return Path("/sys/module/amdgpu/version").read_text().strip()
    except OSError:
        pass
    api = getattr(torch._C, "_cuda_getDriverVersion", None)
    return f"api {api()}" if api else "unknown"


# --- ceilings ----------------------------------------------------------------------------------

_COPY_BLOCK = 4096


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _read_kernel(src, partial, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0)
    tl.store(partial + pid, tl.sum(x, axis=0))


@dataclass(frozen=True)
class Ceilings:
    """Measured limits of one device: what roofline fractions are taken against."""

    device_slug: str
    copy_gbps: float  # read + written bytes per second, 1e9
    read_gbps: float
    bf16_tflops: float
    fp8_tflops: float | None
    fp8_note: str  # the FP8 dtype used, or why there is no FP8 rate
    method: dict[str, Any]  # per measurement: sizes, timing method, cache policy, samples
    date: str  # ISO 8601, UTC
    versions: dict[str, str]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Ceilings:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"ceilings JSON fields {sorted(data)} differ from {sorted(names)}")
        return cls(**data)


def measure_ceilings(device: DeviceInfo, *, buffer_bytes: int = 2 * GiB, matmul_n: int = 8192,
                     samples: int = 20) -> Ceilings:
    """Copy and read bandwidth from Triton kernels on the compute units, BF16 and FP8 GEMM rates.

    Runs on the current torch.cuda device. The copy is a kernel, not `tensor.copy_`: a plain
    copy captured in a graph can become a copy-engine transfer that reads about a third low.
    """
    if not device.is_gpu:
        raise ValueError("no ceilings on CPU: interpreter results are functional only")
    if buffer_bytes < 2 * GiB:
        raise ValueError(f"buffer_bytes must be >= 2 GiB to stream from HBM, got {buffer_bytes}")
    method: dict[str, Any] = {}

    n = buffer_bytes // 4 // _COPY_BLOCK * _COPY_BLOCK
    src = torch.rand(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    partial = torch.empty(n // _COPY_BLOCK, dtype=torch.float32, device="cuda")
    grid = (n // _COPY_BLOCK,)
    copy = time_fn(lambda _: _copy_kernel[grid](src, dst, n, BLOCK=_COPY_BLOCK, num_warps=8),
                   bytes_per_set=8 * n, samples=samples)
    if not torch.equal(src, dst):
        raise RuntimeError("copy kernel produced wrong data; bandwidth would be meaningless")
    read = time_fn(lambda _: _read_kernel[grid](src, partial, n, BLOCK=_COPY_BLOCK, num_warps=8),
                   bytes_per_set=4 * n + 4 * grid[0], samples=samples)
    copy_gbps = 8 * n / copy.median_us / 1e3
    read_gbps = 4 * n / read.median_us / 1e3
    method["copy"] = _method_entry(copy, bytes_per_call=8 * n, kernel="triton large-grid copy")
    method["read"] = _method_entry(read, bytes_per_call=4 * n, kernel="triton block-sum")
    src = dst = partial = None  # free the buffers before the matmul inputs

    flops = 2 * matmul_n**3
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    bf16 = time_fn(lambda _: torch.matmul(a, b, out=c), samples=samples)
    bf16_tflops = flops / bf16.median_us / 1e6
    method["bf16"] = _method_entry(bf16, n=matmul_n, op="torch.matmul")

    fp8_tflops: float | None = None
    if device.fp8_dtype is None:
        fp8_note = f"{device.arch} has no FP8"
    else:
        a8 = a.to(device.fp8_dtype)
        b8 = b.to(device.fp8_dtype).t()  # _scaled_mm wants the second operand column-major
        one = torch.ones((), dtype=torch.float32, device="cuda")

        def scaled_mm(_: int) -> None:
            torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        try:
            scaled_mm(0)
            torch.cuda.synchronize()
        except (RuntimeError, NotImplementedError) as exc:
            fp8_note = f"torch._scaled_mm unsupported: {type(exc).__name__}: {exc}"
        else:
            fp8 = time_fn(scaled_mm, samples=samples)
            fp8_tflops = flops / fp8.median_us / 1e6
            fp8_note = str(device.fp8_dtype).removeprefix("torch.")
            method["fp8"] = _method_entry(fp8, n=matmul_n, op="torch._scaled_mm")
    a = b = c = None  # free the matmul buffers
    torch.cuda.empty_cache()
    return Ceilings(device_slug=device.slug, copy_gbps=copy_gbps, read_gbps=read_gbps,
                    bf16_tflops=bf16_tflops, fp8_tflops=fp8_tflops, fp8_note=fp8_note,
                    method=method, date=dt.datetime.now(dt.timezone.utc).isoformat(),
                    versions={"torch": device.torch_version, "triton": device.triton_version,
                              "runtime": device.runtime_version,
                              "driver": device.driver_version})


def _method_entry(timing: Timing, **details: Any) -> dict[str, Any]:
    return {**details, "timing_method": timing.method, "cache_policy": timing.cache_policy,
            "median_us": timing.median_us, "p10_us": timing.p10_us, "p90_us": timing.p90_us,
            "n_samples": timing.n_samples, "note": timing.note}


def load_or_measure_ceilings(device: DeviceInfo, cache_dir: str | Path | None = None, *,
                             profiles_root: str | Path = "profiles") -> Ceilings | None:
    """Ceilings for `device`: the committed profiles/<slug>/ceilings.json, else the user cache
    (default ~/.cache/qsa/<slug>/ceilings.json), else measured now and written to the user cache.
    A CPU gets None: its results are functional only.
    """
    if not device.is_gpu:
        return None
    user = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "qsa"
    for path in (Path(profiles_root) / device.slug / "ceilings.json",
                 user / device.slug / "ceilings.json"):
        if path.is_file():
            ceilings = Ceilings.from_json(path.read_text())
            if ceilings.device_slug != device.slug:
                raise ValueError(f"{path} holds ceilings of {ceilings.device_slug}, "
                                 f"not {device.slug}")
            return ceilings
    ceilings = measure_ceilings(device)
    target = user / device.slug / "ceilings.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, ceilings.to_json().encode())
    return ceilings
