"""What every kernel module needs: the active backend and arch, config lookup, kernel names
that carry their config, and input checks with messages that name the problem."""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Iterator

import torch
try:  # programmatic dependent launch's device calls (PTX griddepcontrol)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton build without the NVIDIA extras: dependent launch is off there
    gdc_launch_dependents = gdc_wait = None

from qsa.configs import BlockConfig, get_config
from qsa.configs.schema import SM90, takes


class KernelInputError(ValueError):
    """An input a kernel can not take (dtype, shape, layout, index range, row count)."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@lru_cache(maxsize=None)
def backend_and_arch() -> tuple[str, str]:
    """('cuda', 'sm90'), ('hip', 'gfx950'), or ('interpreter', 'default')."""
    if interpreting() or not torch.cuda.is_available():
        return "interpreter", "default"
    from triton.runtime import driver

    target = driver.active.get_current_target()
    if target.backend == "hip":
        return "hip", str(target.arch).split(":")[0]
    return target.backend, f"sm{target.arch}"


def has_dependent_launch(backend: str, arch: str) -> bool:
    """Whether the device takes programmatic dependent launch: NVIDIA sm90 and newer."""
    return takes(SM90, backend, arch)


def dependent_launch_here() -> bool:
    """Whether launches on the current device can use programmatic dependent launch (the
    interpreter runs grids one after another, so there it is off)."""
    backend, arch = backend_and_arch()
    return (backend != "interpreter" and gdc_wait is not None
            and has_dependent_launch(backend, arch))


@dataclass(frozen=True)
class Lookup:
    """One config resolution of a kernel call: the table coordinate the kernel asked for
    (its config bucket rule applied to the call's shape) and the config it launched."""

    kernel: str
    fmt: str
    size: int
    config: BlockConfig
    explicit: bool


_OBSERVED: contextvars.ContextVar[list[Lookup] | None] = contextvars.ContextVar(
    "qsa_observed_lookups", default=None)


@contextlib.contextmanager
def observe_lookups() -> Iterator[list[Lookup]]:
    """Collect every config lookup made inside the block. The tuner learns a call's table
    coordinate this way, from the kernel itself: each kernel maps its shape to a bucket in one
    place (its `lookup` call), and no second copy of that rule can drift from it."""
    seen: list[Lookup] = []
    token = _OBSERVED.set(seen)
    try:
        yield seen
    finally:
        _OBSERVED.reset(token)


def lookup(kernel: str, fmt: str, size: int, config: BlockConfig | None = None
           ) -> tuple[BlockConfig, dict]:
    """An explicit config wins; otherwise the table entry for this arch nearest to `size`,
    the kernel's config coordinate. Returns the config and the launch keywords filtered for
    the active backend."""
    backend, arch = backend_and_arch()
    cfg = config if config is not None else get_config(kernel, arch, fmt, size).config
    seen = _OBSERVED.get()
    if seen is not None:
        seen.append(Lookup(kernel, fmt, int(size), cfg, config is not None))
    return cfg, cfg.launch_kwargs(backend, arch)


def kernel_repr(name: str, constexprs: Iterable[str]) -> Callable:
    """`@triton.jit(repr=...)` callback: `qsa_<name>_<K><v>_...` so profiler rows say what ran."""
    keys = tuple(constexprs)

    def _repr(spec) -> str:
        c = spec.constants
        parts = [f"{k}{c[k]}" for k in keys if k in c]
        return "_".join([f"qsa_{name}", *parts])

    return _repr


def require(cond: bool, message: str) -> None:
    if not cond:
        raise KernelInputError(message)


def require_dtype(t: torch.Tensor, name: str, dtypes: Iterable[torch.dtype]) -> None:
    ds = tuple(dtypes)
    require(t.dtype in ds, f"{name}: dtype {t.dtype} is not one of {', '.join(map(str, ds))}")


def require_inner_contiguous(t: torch.Tensor, name: str, dims: int) -> None:
    """The last `dims` dims must be packed (the block dim may have any stride: arena views)."""
    expect = 1
    for d in range(t.dim() - 1, t.dim() - 1 - dims, -1):
        require(t.stride(d) == expect or t.shape[d] == 1,
                f"{name}: inner dims must be contiguous, got strides {t.stride()} for shape "
                f"{tuple(t.shape)}")
        expect *= t.shape[d]


def data_checks_enabled() -> bool:
    """Checks that read device data (page ids, positions) need a host sync. They run on eager
    calls and are skipped while a CUDA graph is being captured, or everywhere with
    QSA_KERNEL_DATA_CHECKS=0 (serving without graphs). The kernels still clamp or mask what those
    checks guard, so a bad table writes nothing instead of scribbling over the arena."""
    if os.environ.get("QSA_KERNEL_DATA_CHECKS", "1") == "0":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def storage_dtypes() -> tuple[torch.dtype, ...]:
    """BF16 storage; fp32 too under the interpreter, whose bf16 arithmetic is broken and whose
    tests hand kernels fp32 copies (tests/support.py)."""
    return (torch.bfloat16, torch.float32) if interpreting() else (torch.bfloat16,)


def kv_code_planes(cache: dict[str, torch.Tensor], kv_format: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V code planes of a cache, after checking the format name and that both exist."""
    from qsa.formats import check_kv_format

    try:
        check_kv_format(kv_format)
    except ValueError as e:
        raise KernelInputError(str(e)) from None
    for name in ("k", "v"):
        require(name in cache, f"cache: no '{name}' field")
    return cache["k"], cache["v"]


def kv_scale_planes(cache: dict[str, torch.Tensor], kv_format: str
                    ) -> list[tuple[str, torch.Tensor]]:
    """Check the K/V code planes and, for FP8, their FP32 scale planes [blocks, block, Hkv];
    returns every plane the kernel reads or writes, by name, for the layout checks."""
    from qsa.formats import FP8_DTYPES

    kc = cache["k"]
    planes = [("k", kc), ("v", cache["v"])]
    if kv_format != "fp8":
        require_dtype(kc, "cache['k']", storage_dtypes())
        return planes
    require_dtype(kc, "cache['k']", FP8_DTYPES)
    for name in ("k_scale", "v_scale"):
        require(name in cache, f"cache: an FP8 cache needs its '{name}' plane")
        s = cache[name]
        require(tuple(s.shape) == tuple(kc.shape[:3]),
                f"cache['{name}']: expected {tuple(kc.shape[:3])}, got {tuple(s.shape)}")
        require_dtype(s, f"cache['{name}']", (torch.float32,))
        require(s.device == kc.device, f"cache['{name}']: on {s.device}, not {kc.device}")
        planes.append((name, s))
    return planes


def check_index_planes(cache: dict[str, torch.Tensor], fmt: str, dim: int, block_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`index_compressed` and its scale plane (None for BF16), checked against the storage
    layout of `fmt` (`qsa.formats.index_layout`, which the arena declares its fields from), so
    no kernel keeps a list of its own of what these planes look like."""
    from qsa.formats import FP8_DTYPES, index_layout

    require("index_compressed" in cache,
            f"cache: missing field 'index_compressed' (has {', '.join(cache)})")
    keys = cache["index_compressed"]
    lay = index_layout(fmt, dim, keys.dtype if keys.dtype in FP8_DTYPES else FP8_DTYPES[0])
    gpb = block_size // 4
    want = (gpb, 1, *lay.code_shape)
    require(keys.dim() == 4 and tuple(keys.shape[1:]) == want,
            f"index_compressed: shape {tuple(keys.shape)} is not [blocks, "
            f"{', '.join(map(str, want))}]")
    require_inner_contiguous(keys, "index_compressed", 3)
    codes = {"bf16": storage_dtypes(), "fp8": FP8_DTYPES}.get(fmt, (lay.code_dtype,))
    require_dtype(keys, "index_compressed", codes)
    if lay.scale_dtype is None:
        return keys, None
    require("index_compressed_scale" in cache,
            f"cache: index format {fmt} needs field 'index_compressed_scale'")
    scales = cache["index_compressed_scale"]
    want = (keys.shape[0], gpb, 1, *lay.scale_shape)
    require(tuple(scales.shape) == want, f"index_compressed_scale: shape "
            f"{tuple(scales.shape)} is not [{', '.join(map(str, want))}]")
    require_dtype(scales, "index_compressed_scale", (lay.scale_dtype,))
    require_inner_contiguous(scales, "index_compressed_scale", scales.dim() - 1)
    return keys, scales


@lru_cache(maxsize=None)
def _unit_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def unit_count(device: torch.device) -> int:
    """SMs / CUs of the device; 1 under the interpreter (its grids run one program at a time,
    so tests stay small)."""
    if interpreting() or device.type != "cuda":
        return 1
    return _unit_count(device.index if device.index is not None else torch.cuda.current_device())
