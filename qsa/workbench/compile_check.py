"""Ahead-of-time compile of every kernel with every config of its tables, for GPUs that are not
at hand: sm90 (H200), gfx950 (MI355X) and gfx942 (MI300X), on the CPU.

Why: a table entry for an arch nobody can run here must still compile there, and it must not
spill; a config that only fails on the target would otherwise surface on a user's machine. The
kernels are compiled through their real wrappers, so the signature, the specialisation and the
constexprs are exactly what a launch on that device would compile: a stand-in driver reports
the target, every launch becomes a warm-up (compile, no run), and the table lookup sees the
target's arch and backend (AMD launch keys included). Inputs are every op's smoke points
(`qsa.workbench.registry`, which the smoke suite runs too), in production dtypes (bf16, and the
arch's FP8 flavour). Registers, spills and shared memory come from the compiled code: `ptxas -v`
for sm90, the AMDGPU kernel descriptor for gfx9. With `sass`, each kernel's opcode histogram
too (the SASS from the nvdisasm Triton ships on sm90, the instructions of the assembly Triton
keeps on gfx9), so two revisions' outputs can be diffed (`diff_checks`) before anything
reaches a GPU.

It must run without TRITON_INTERPRET (the interpreter never compiles); `qsa compile-check`
starts it in its own process, one process and a fresh Triton cache per target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

# arch -> (backend, Triton arch, warp size, SMs / CUs of the GPU the tables are for: H200,
# MI355X, MI300X, so split and chunk counts come out as on that device).
TARGETS: dict[str, tuple[str, int | str, int, int]] = {
    "sm90": ("cuda", 90, 32, 132), "gfx950": ("hip", "gfx950", 64, 256),
    "gfx942": ("hip", "gfx942", 64, 304)}
# Shared memory (LDS) one program may use: sm90's opt-in 227 KiB per block (CUDA programming
# guide, compute capability 9.0), 160 KiB of LDS per CU on gfx950 and 64 KiB on gfx942 (ROCm
# GPU specifications). A launch checks it at load time, which a compile-only run never
# reaches, so the check compares it here.
SHARED_LIMIT = {"sm90": 227 * 1024, "gfx950": 160 * 1024, "gfx942": 64 * 1024}
PRESET = "qwen3.8-flash-next"  # the model's dimensions, on the smoke points' small shapes
SPILLS_MEASURED = "spills (tuned on the device: kept)"
PASSING = ("ok", SPILLS_MEASURED)
# Beside the table `X.csv`, `X.sass.json` holds its rows with their opcode histograms.
SASS_SUFFIX = ".sass.json"
HISTOGRAMS = ("opcodes", "loop_opcodes")  # the columns of the JSON that the CSV leaves out
# Per-kernel counts a row may lack (a failed compile, another target's or a run without
# `sass`): what a diff moves, and what the table writes as integers.
COUNTS = ("registers", "sgprs", "spill_bytes", "shared_bytes", "instructions",
          "loop_instructions")
# What identifies a compiled kernel across two outputs, with its place among the kernels its
# config launches (names change with every constexpr, so they can not be the key).
DIFF_KEYS = ("arch", "op", "index_format", "kv_format", "fmt", "bucket", "launch")


class CompileCheckError(RuntimeError):
    """The check can not run here (an interpreter session, an unknown target)."""


@dataclasses.dataclass
class _StandInDriver:
    """What `JITFunction.run` asks the active driver for, answered for a target GPU."""

    target: Any

    def get_current_device(self) -> str:
        return f"{self.target.backend}:{self.target.arch}"  # one binder cache per target

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compiling_for(arch: str) -> Iterator[list[tuple[str, Any]]]:
    """Inside: launches compile for `arch` instead of running, and the config lookup answers
    for `arch`. Yields the list that collects (kernel name, compiled kernel) per launch."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import qsa.kernels.common as common
    import qsa.workbench.ops as ops
    import qsa.workbench.verify as verify
    from qsa.measure.device import cpu_device, fp8_flavour_for_arch

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise CompileCheckError("the compile check needs TRITON_INTERPRET unset (the "
                                "interpreter compiles nothing); run `qsa compile-check`")
    if arch not in TARGETS:
        raise CompileCheckError(f"arch: {arch!r} is not one of {', '.join(TARGETS)}")
    backend, gpu_arch, warp, units = TARGETS[arch]
    compiled: list[tuple[str, Any]] = []
    real_run = JITFunction.run

    def warm_run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        kernel = real_run(self, *args, grid=grid, warmup=True, **kw)
        compiled.append((kernel.name, kernel))
        return kernel

    device = dataclasses.replace(cpu_device(), fp8_dtype=fp8_flavour_for_arch(arch)[0])
    # every kernel module that imported unit_count by name sees the target's count
    users = [m for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("qsa.kernels.")
             and getattr(m, "unit_count", None) is common.unit_count]
    saved = (common.backend_and_arch, verify.interpreting, ops.detect_device)
    previous = driver._active  # None on a machine without a GPU (no default driver exists)
    driver.set_active(_StandInDriver(GPUTarget(backend, gpu_arch, warp)))
    JITFunction.run = warm_run
    common.backend_and_arch = lambda: (backend, arch)
    verify.interpreting = lambda device: False  # production dtypes, no fp32 surrogates
    ops.detect_device = lambda index=0: device
    real_units = common.unit_count
    for m in users:
        m.unit_count = lambda dev: units
    try:
        yield compiled
    finally:
        for m in users:
            m.unit_count = real_units
        JITFunction.run = real_run
        common.backend_and_arch, verify.interpreting, ops.detect_device = saved
        driver._active = previous


def _ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers, spill bytes and stack of an sm90 kernel, from the ptxas Triton ships."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        res = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o",
                              os.devnull], capture_output=True, text=True, check=True)
    text = res.stderr

    def num(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return {"registers": num(r"Used (\d+) registers"),
            "spill_bytes": num(r"(\d+) bytes spill stores") + num(r"(\d+) bytes spill loads")}


def _amdgpu_usage(asm: str) -> dict[str, int]:
    """VGPRs, SGPRs and spills of a gfx9 kernel, from its AMDGPU metadata notes."""

    def num(key: str) -> int:
        m = re.search(rf"\.{key}:\s+(\d+)", asm)
        return int(m.group(1)) if m else 0

    return {"registers": num("vgpr_count"), "sgprs": num("sgpr_count"),
            "spill_bytes": num("vgpr_spill_count") + num("sgpr_spill_count")
            + num("private_segment_fixed_size")}


def sm90_sass(cubin: bytes) -> str:
    """The SASS of an sm90 cubin, from the nvdisasm Triton ships."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);",
                        re.M)
_SASS_LABEL = re.compile(r"^\.(L_x_\d+):\s*\n\s+/\*([0-9a-f]+)\*/", re.M)


def loop_opcodes(sass: str) -> list[str]:
    """Opcodes of a kernel's main loop: from the target of its longest backward branch to the
    branch, in order, leaving out branches whose span holds an EXIT. Their count per warp and
    per loop trip is what an issue-bound kernel's time follows, so kernel changes are compared
    on it before they reach a GPU. A warp-specialized kernel's warps run their partitions
    from one dispatch loop, whose back edge spans every partition and their EXITs: the main
    loop is then the longest partition loop (the compute warps')."""
    lines = [(int(addr, 16), op, rest) for addr, op, rest in _SASS_LINE.findall(sass)]
    labels = {m.group(1): int(m.group(2), 16) for m in _SASS_LABEL.finditer(sass)}
    exits = [addr for addr, op, _ in lines if op == "EXIT"]
    lo = hi = 0
    for addr, op, rest in lines:
        target = re.search(r"\.(L_x_\d+)", rest)
        if op.startswith("BRA") and target and target.group(1) in labels:
            start = labels[target.group(1)]
            if (start < addr and addr - start > hi - lo
                    and not any(start <= e <= addr for e in exits)):
                lo, hi = start, addr
    return [op for addr, op, _ in lines if lo <= addr <= hi] if hi else []


def sass_opcodes(sass: str) -> Counter[str]:
    """Opcode histogram of a kernel's SASS, without padding (NOPs and the branch-to-self after
    the last EXIT), whose count follows the code's size and alignment, not what it does."""
    labels = {m.group(1): int(m.group(2), 16) for m in _SASS_LABEL.finditer(sass)}
    hist: Counter[str] = Counter()
    for addr, op, rest in _SASS_LINE.findall(sass):
        target = re.search(r"\.(L_x_\d+)", rest)
        to_self = target is not None and labels.get(target.group(1)) == int(addr, 16)
        if op == "NOP" or (op == "BRA" and to_self):
            continue
        hist[op] += 1
    return hist


def amdgcn_opcodes(asm: str) -> Counter[str]:
    """Instruction histogram of a gfx9 kernel's assembly (`kernel.asm["amdgcn"]`): the mnemonic
    of every instruction line (a tab, then a lower-case word); directives, labels and comments
    are left out."""
    return Counter(re.findall(r"^\t([a-z][a-z0-9_]*)", asm, re.M))


def isa_record(arch: str, kernel: Any) -> dict[str, Any]:
    """A compiled kernel's instruction count and opcode histogram; on sm90 also its main loop's
    (`loop_opcodes`), the count the compile-loop comparisons of kernel changes followed."""
    if TARGETS[arch][0] != "cuda":
        hist = amdgcn_opcodes(kernel.asm["amdgcn"])
        return {"instructions": sum(hist.values()), "opcodes": dict(hist)}
    sass = sm90_sass(kernel.asm["cubin"])
    hist, loop = sass_opcodes(sass), loop_opcodes(sass)
    return {"instructions": sum(hist.values()), "loop_instructions": len(loop),
            "opcodes": dict(hist), "loop_opcodes": dict(Counter(loop))}


def sm90_loops(point: Any, skip: str = "") -> list[tuple[str, Any, list[str]]]:
    """(name, compiled kernel, `loop_opcodes`) of every kernel a workbench point launches,
    compiled for sm90 on this machine (its inputs built on the CPU, nothing runs), leaving out
    kernels whose name contains `skip`: for comparing a kernel change before it reaches a GPU."""
    from qsa.workbench.ops import prepare

    with compiling_for("sm90") as compiled:
        prepare(point, "cpu").call(0, None)
        return [(name, kernel, loop_opcodes(sm90_sass(kernel.asm["cubin"])))
                for name, kernel in compiled if not (skip and skip in name)]


def usage(arch: str, kernel: Any) -> dict[str, int]:
    """Resource use of one compiled kernel: registers (VGPRs on AMD), spills, shared memory."""
    base = {"shared_bytes": int(kernel.metadata.shared)}
    if TARGETS[arch][0] == "cuda":
        return {**base, **_ptxas_usage(kernel.asm["ptx"])}
    return {**base, **_amdgpu_usage(kernel.asm["amdgcn"])}


def table_entries(kernel: str, arch: str) -> list[tuple[str, str, int, Any, bool]]:
    """(table arch, format, bucket, config, measured there) of every entry the kernel's lookup
    can return on `arch`: the arch's own entries, else the "default" ones it falls back to.
    "Measured there": tuned on a device of that arch, verified and timed against the entry it
    replaced (its provenance says so)."""
    from qsa.configs import BlockConfig, load_table

    table = load_table(kernel)
    use = arch if arch in table else "default"
    return [(use, fmt, int(bucket), BlockConfig.from_dict(entry), _measured_on(entry, arch))
            for fmt, buckets in table.get(use, {}).items() for bucket, entry in buckets.items()]


def _measured_on(entry: dict[str, Any], arch: str) -> bool:
    prov = entry.get("provenance", {})
    return bool(prov.get("tuned")) and prov.get("arch") == arch and "us" in prov


def _status(usage_: dict[str, int], arch: str, measured: bool) -> str:
    """A spill is a finding where nobody timed the config on the target; an entry the tuner
    timed there against the alternatives, spills included, is kept (the spill cost is in its
    time)."""
    if usage_["spill_bytes"]:
        return SPILLS_MEASURED if measured else "spills"
    return "exceeds shared memory" if usage_["shared_bytes"] > SHARED_LIMIT[arch] else "ok"


def check(arch: str, ops_filter: set[str] | None = None,
          sass: bool = False) -> list[dict[str, Any]]:
    """One row per (smoke point, table entry of its kernel and format, launched kernel), and
    per path a spec forces on (`OpSpec.forced`); status "ok", "spills", SPILLS_MEASURED (an
    entry the tuner timed on the target, spills and all: not a failure), "exceeds shared
    memory" or "error" (did not compile). With `sass`, every compiled kernel's `isa_record`
    too."""
    import qsa.kernels
    from qsa.presets import as_preset
    from qsa.workbench.ops import Point, env_overrides, prepare
    from qsa.workbench.suites import smoke_points

    for mod in pkgutil.iter_modules(qsa.kernels.__path__):  # loaded before the patching
        importlib.import_module(f"qsa.kernels.{mod.name}")
    preset = as_preset(PRESET)
    rows: list[dict[str, Any]] = []
    seen = set()
    with compiling_for(arch) as compiled:
        for pt in smoke_points():
            args = {"rows": preset.rows_per_verify, **pt, "selection": "index"}
            point = Point(args.pop("op"), preset, **args)
            key = (point.op, point.index_format, point.kv_format)
            if (ops_filter and point.op not in ops_filter) or key in seen:
                continue
            seen.add(key)
            spec = point.spec
            entries = [e for e in table_entries(spec.table, arch)
                       if e[1] in point.table_formats]
            if not entries:
                continue
            prep = prepare(point, "cpu")
            record = {k: v for k, v in point.as_record().items() if k != "preset"}

            def compile_rows(head: dict[str, Any], cfg: Any, measured: bool) -> None:
                compiled.clear()
                try:
                    prep.call(0, cfg)
                except Exception as e:  # a config that does not compile: the finding
                    rows.append({**head, "kernel": "", "status": "error",
                                 "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    return
                for launch, (name, k) in enumerate(compiled):
                    u = usage(arch, k)
                    rows.append({**head, "launch": launch, "kernel": name, **u,
                                 "status": _status(u, arch, measured), "error": "",
                                 **(isa_record(arch, k) if sass else {})})

            for table_arch, fmt, bucket, cfg, measured in entries:
                compile_rows({"arch": arch, "op": point.op, "table_arch": table_arch,
                              "fmt": fmt, "bucket": bucket,
                              "config": json.dumps(cfg.as_dict(), sort_keys=True), **record},
                             cfg, measured)
            for forced in spec.forced:
                # A path of larger shapes (prefill keys decoded once), forced on the smoke
                # shape, through the lookups production makes.
                if point.fmt in spec.schema.key(forced.key).formats:
                    with env_overrides({forced.env.resolve(): "1"}):
                        compile_rows({"arch": arch, "op": point.op, "table_arch": arch,
                                      "fmt": point.fmt, "bucket": 0, "config": forced.label,
                                      **record}, None, False)
    return rows


def main(argv: list[str]) -> int:
    """`python -m qsa.workbench.compile_check OUT_CSV ARCH [ARCH ...] [--ops a,b] [--sass]`:
    the process `qsa compile-check` starts; exit 1 when a config fails to compile or spills.

    Several targets run one process each, as on real hosts: Triton 3.6 keeps target-dependent
    state per process, and compiling gfx950 first made gfx942's FP8 conversions fail
    (`profiles/compile/NOTES.md`)."""
    sass = "--sass" in argv
    argv = [a for a in argv if a != "--sass"]
    ops_args: list[str] = []
    if "--ops" in argv:
        i = argv.index("--ops")
        ops_args = argv[i:i + 2]
        argv = argv[:i] + argv[i + 2:]
    out, archs = Path(argv[0]), argv[1:]
    if len(archs) == 1:
        # A fresh compile cache: a warm one can hand back a kernel compiled earlier and hide a
        # failure.
        with tempfile.TemporaryDirectory(prefix="qsa-compile-check-") as cache:
            os.environ["TRITON_CACHE_DIR"] = cache
            rows = check(archs[0], set(ops_args[1].split(",")) if ops_args else None, sass)
    else:
        rows = []
        with tempfile.TemporaryDirectory(prefix="qsa-compile-check-") as tmp:
            for arch in archs:
                part = Path(tmp) / f"{arch}.csv"
                res = subprocess.run([sys.executable, "-m", "qsa.workbench.compile_check",
                                      str(part), arch, *ops_args, *(["--sass"] if sass else [])],
                                     stdout=subprocess.DEVNULL)
                if not part.exists():  # the compile process itself died
                    rows.append({"arch": arch, "status": "compile process died",
                                 "error": f"exit code {res.returncode}"})
                else:
                    rows += read_rows(part)
    write_check(rows, out, sass)
    bad = [r for r in rows if r["status"] not in PASSING]
    for r in bad:
        print(f"{r['arch']} {r.get('op', '')} {r.get('fmt', '')} bucket {r.get('bucket', '')}: "
              f"{r['status']} {r.get('error') or r.get('kernel', '')}")
    print(f"{len(rows)} compiled kernels, {len(bad)} failing; table: {out}"
          + (f"; opcode histograms: {sass_path(out)}" if sass else ""))
    return 1 if bad or not rows else 0


def sass_path(table: Path) -> Path:
    """The JSON beside a compile-check table that holds its rows with their histograms."""
    return table.with_name(table.stem + SASS_SUFFIX)


def write_check(rows: list[dict[str, Any]], out: Path, sass: bool) -> None:
    """The table (CSV, histograms left out) and, with `sass`, every row with its histograms as
    JSON beside it, with the Triton version that compiled them."""
    import triton

    out.parent.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    for c in COUNTS:  # counts that only some rows have (SGPRs: gfx9 only) stay integers
        if c in df:
            df[c] = df[c].astype("Int64")
    df.drop(columns=[c for c in HISTOGRAMS if c in df]).to_csv(out, index=False)
    if sass:
        doc = {"triton": triton.__version__, "rows": rows}
        sass_path(out).write_text(json.dumps(doc, indent=1) + "\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one compile-check output: its JSON (histograms included) where it has one,
    else its CSV; `path` is the table, its JSON or their folder."""
    path = Path(path)
    if path.is_dir():
        path = path / "compile_check.csv"
    if path.name.endswith(SASS_SUFFIX):
        return json.loads(path.read_text())["rows"]
    if sass_path(path).is_file():
        return json.loads(sass_path(path).read_text())["rows"]
    if not path.is_file():
        raise ValueError(f"{path}: not a compile-check output (a table, its {SASS_SUFFIX} "
                         "or their folder)")
    if len(path.read_text().strip()) <= 2:  # an empty table is '""'
        return []
    df = pd.read_csv(path)
    return [{k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))}
            for r in df.to_dict("records")]  # a cell left empty: a key the row does not have


def diff_checks(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]],
                top: int = 4) -> pd.DataFrame:
    """Per compiled kernel (`DIFF_KEYS`), its counts in A and B (`<count>_a`, `<count>_b`,
    `d_<count>` = B - A), the `top` opcodes whose count moved most (by base opcode: HGMMA,
    LDG, ...; from the histograms of `--sass` outputs), and `change`: "changed", "same",
    "only in A" or "only in B". `config` says whether the table entry itself changed."""
    cols = tuple(c for c in COUNTS if c != "sgprs")
    frames = []
    for rows in (a, b):  # a config that failed to compile has no kernel: nothing to diff
        df = pd.DataFrame([r for r in rows if isinstance(r.get("kernel"), str) and r["kernel"]])
        if len(df) and "launch" not in df:  # tables written before the launch column
            df["launch"] = df.groupby(list(DIFF_KEYS[:-1]), sort=False, dropna=False).cumcount()
        frames.append(df.reindex(columns=[*DIFF_KEYS, "kernel", "config", *cols, "opcodes"]))
    both = frames[0].merge(frames[1], on=list(DIFF_KEYS), how="outer", suffixes=("_a", "_b"),
                           indicator=True, sort=False)
    out = []
    for r in both.to_dict("records"):
        row = {k: r[k] for k in DIFF_KEYS}
        row["kernel"] = r["kernel_b"] if isinstance(r["kernel_b"], str) else r["kernel_a"]
        for c in cols:
            row[f"{c}_a"], row[f"{c}_b"] = r[f"{c}_a"], r[f"{c}_b"]
            row[f"d_{c}"] = r[f"{c}_b"] - r[f"{c}_a"]
        row["opcodes"] = _opcode_moves(r["opcodes_a"], r["opcodes_b"], top)
        if r["_merge"] != "both":
            row["config"] = ""
            row["change"] = "only in A" if r["_merge"] == "left_only" else "only in B"
        else:
            row["config"] = "same" if r["config_a"] == r["config_b"] else "changed"
            moved = any(row[f"d_{c}"] for c in cols if not math.isnan(row[f"d_{c}"]))
            row["change"] = ("changed" if moved or row["opcodes"] or row["config"] == "changed"
                             else "same")
        out.append(row)
    counts = [n for c in cols for n in (f"{c}_a", f"{c}_b", f"d_{c}")]
    return pd.DataFrame(out, columns=[*DIFF_KEYS, "kernel", *counts, "opcodes", "config",
                                      "change"]).sort_values(list(DIFF_KEYS), kind="stable",
                                                             ignore_index=True)


def _opcode_moves(a: Any, b: Any, top: int) -> str:
    """"HGMMA +8, LDG -2": the base opcodes whose count moved most from A to B ("" when either
    side has no histogram, or nothing moved)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return ""
    base: list[Counter[str]] = [Counter(), Counter()]
    for side, hist in zip(base, (a, b)):
        for op, n in hist.items():
            side[op.split(".")[0]] += n
    moves = {op: base[1][op] - base[0][op] for op in base[0].keys() | base[1].keys()}
    moved = sorted((op for op in moves if moves[op]), key=lambda op: (-abs(moves[op]), op))
    return ", ".join(f"{op} {moves[op]:+d}" for op in moved[:top])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
