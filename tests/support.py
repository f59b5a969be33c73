"""Shared test helpers.

Interpreter surrogate: the Triton interpreter multiplies bf16 bit patterns in `tl.dot` and
mishandles bf16 arithmetic (triton-lang/triton #11584, #4972). On CPU, tests hand kernels fp32
copies of bf16 tensors (the kernels are dtype-generic). A CPU pass then means indexing, masking,
paging and control flow are right, not that bf16 numerics are; the GPU run checks those with the
production dtypes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"


def surrogate(t: torch.Tensor) -> torch.Tensor:
    """fp32 copy of a bf16 tensor under the interpreter; the tensor itself on a GPU."""
    if INTERPRETING and t.dtype == torch.bfloat16:
        return t.float()
    return t


def surrogate_cache(cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: surrogate(v) for k, v in cache.items()}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    """An output buffer pre-filled so that any element a kernel fails to write is caught."""
    from qsa.cases import poison_

    return poison_(torch.empty(shape, dtype=dtype, device=device))


def replay_captured(call, out: torch.Tensor) -> None:
    """Run `call` once (compiles it), capture it in a CUDA graph, poison `out` (which `call`
    writes) and replay the graph: `out` then holds only what the replay wrote."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def tiny_preset():
    """A preset small enough for the interpreter: 2 KV heads, GQA group 2, head dim 64,
    index dim 64, 16-token pages, top-8 groups, 2 QSA layers."""
    from qsa.presets import get_preset

    return get_preset(num_q_heads=4, num_kv_heads=2, head_dim=64, index_dim=64, rope_dims=32,
                      block_size=16, topk_groups=8, num_layers=8)


_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx950", 64)):
    for sig, consts, options in spec["variants"]:
        triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
"""


def compile_for_gpu_targets(module: str, kernel: str, variants: list) -> None:
    """Compile a kernel for sm90 and gfx950 without a GPU (Triton ships ptxas and lld), in a
    process without TRITON_INTERPRET: catches GPU-only type and shape errors the interpreter
    lets through. variants: (signature, constexprs, options) triples."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    spec = json.dumps({"module": module, "kernel": kernel, "variants": variants})
    res = subprocess.run([sys.executable, "-c", _COMPILE, spec], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]


class FakeDevice:
    """What `qsa.measure.results.start_run` reads of a `DeviceInfo` (slug, versions, the record
    stored in run.json), for tests that write a run as if a given device had made it."""

    def __init__(self, slug: str = "nvidia-h200", name: str = "NVIDIA H200",
                 torch_version: str = "2.11.0", triton_version: str = "3.6.0") -> None:
        self.slug, self.name = slug, name
        self.torch_version, self.triton_version = torch_version, triton_version

    def as_record(self) -> dict:
        return {"slug": self.slug, "name": self.name}
