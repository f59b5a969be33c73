"""Config schemas: every key a kernel's table entries may carry, declared as data beside the
tables they describe.

A table entry holds meta keys (constexprs of the kernel, or host-side knobs of its launch plan),
the launch keys `num_warps` and `num_stages`, and AMD-only launch keys under "amd". For each meta
key a table's schema says what kind of value it is (which is also how the tuner searches it),
its range, the value a config that leaves it out runs with, whether the kernel takes it as a
constexpr or reads it on the host, which formats' entries carry it, and which devices can take
it. `qsa.configs.load_table` and `write_entry` refuse an entry that breaks its schema, naming
the table, arch, format, bucket and key; `tests/test_registry.py` holds every shipped table to
its schema and the schemas to the tables (no switch that no entry turns on).

Why here and not in the kernel modules: the kernels import `qsa.configs`, so a table can be
checked where it is loaded only if its schema sits at or below it. The rest of what an op is
(kernel, reference, inputs, tolerance, suite points) is declared in `qsa.workbench.registry`,
which names each op's schema by its table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["size", "count", "switch", "held"]
SIZE: Kind = "size"  # a power of two in [low, high]; the tuner tries half and double
COUNT: Kind = "count"  # an integer in [low, high]; the tuner tries half and double
SWITCH: Kind = "switch"  # 0 or 1, a step of the kernel off or on; the tuner tries both
# An integer in [low, high] that decides which path or entry a call takes, not how fast an
# entry runs: one shape's timing can not place it, so the tuner holds it.
HELD: Kind = "held"

# Devices a key is limited to (`Key.only_on`): NVIDIA sm90 and newer, or AMD (HIP).
SM90 = "sm90"
HIP = "hip"
ENTRY_FIELDS = ("meta", "num_warps", "num_stages", "amd", "provenance", "impl")
# Implementations an entry may name under "impl" (absent: "triton"): the portable Triton kernel,
# or a Gluon one (`triton.experimental.gluon`, NVIDIA sm90) where a table's schema lists it.
IMPLS = ("triton", "gluon")


class ConfigError(ValueError):
    """A config table or entry is missing, malformed or outside its schema."""


def takes(only_on: str | None, backend: str, arch: str) -> bool:
    """Whether a device (`backend` 'cuda'/'hip'/'interpreter', `arch` 'sm90', 'gfx950', ...)
    takes a key limited to `only_on` (None: every device)."""
    if only_on is None:
        return True
    if only_on == HIP:
        return backend == "hip"
    version = arch[2:] if arch.startswith("sm") else ""
    return backend == "cuda" and version.isdigit() and int(version) >= 90


def section_backend(arch: str) -> str | None:
    """The backend of a table's arch section ('sm90' -> 'cuda', 'gfx950' -> 'hip'); None for
    "default", which serves every device without a section of its own."""
    if arch.startswith("sm"):
        return "cuda"
    return "hip" if arch.startswith("gfx") else None


@dataclass(frozen=True)
class Key:
    """One config key. `default`: the value a config that leaves the key out runs with; None
    where there is none (the kernel refuses such a config, or the key's absence is a case of
    its own, which `doc` says). `formats`: the table formats whose entries carry it (empty: all).
    `only_on`: the devices that take it (None: all). `impls`: the implementations whose
    entries carry it (empty: all)."""

    name: str
    kind: Kind
    low: int
    high: int
    doc: str
    default: int | None = None
    host: bool = False  # read by the wrapper's launch plan, not a constexpr of the kernel
    formats: tuple[str, ...] = ()
    only_on: str | None = None
    impls: tuple[str, ...] = ()

    def allows(self, value: Any) -> bool:
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        if self.kind == SWITCH:
            return value in (0, 1)
        if self.kind == SIZE and (value < 1 or value & (value - 1)):
            return False
        return self.low <= value <= self.high

    def describe(self) -> str:
        """What values the key takes, for error messages."""
        if self.kind == SWITCH:
            return "0 or 1"
        what = "a power of two" if self.kind == SIZE else "an integer"
        return f"{what} in {self.low}..{self.high}"


@dataclass(frozen=True)
class ConfigSchema:
    """The keys of one config table. `formats` maps each format key of the table to the storage
    format its entries serve (sparse GQA's "fp8-shared" serves "fp8" K/V). `impls`: the
    implementations its entries may name, with the formats and arch each serves."""

    table: str
    formats: dict[str, str]
    keys: tuple[Key, ...]
    impls: dict[str, tuple[tuple[str, ...], str | None]] = field(
        default_factory=lambda: {"triton": ((), None)})

    def key(self, name: str) -> Key:
        for k in self.keys:
            if k.name == name:
                return k
        raise ConfigError(f"{self.table}: no config key {name!r} (keys: "
                          f"{', '.join(k.name for k in self.keys)})")

    def keys_of(self, fmt: str, impl: str = "triton") -> tuple[Key, ...]:
        """The keys entries of format `fmt` and implementation `impl` may carry."""
        return tuple(k for k in self.keys if (not k.formats or fmt in k.formats)
                     and (not k.impls or impl in k.impls))

    def check_entry(self, entry: Any, arch: str, fmt: str, where: str) -> None:
        """Raise ConfigError, prefixed by `where`, unless `entry` is an entry of format `fmt`
        that the `arch` section may hold."""
        if fmt not in self.formats:
            raise ConfigError(f"{where}: format {fmt!r} is not one of "
                              f"{', '.join(self.formats)}")
        if not isinstance(entry, dict) or not isinstance(entry.get("meta"), dict):
            raise ConfigError(f"{where}: an entry is a mapping with a 'meta' mapping")
        extra = sorted(set(entry) - set(ENTRY_FIELDS))
        if extra:
            raise ConfigError(f"{where}: unknown fields {extra} (fields: "
                              f"{', '.join(ENTRY_FIELDS)})")
        impl = entry.get("impl", "triton")
        backend = section_backend(arch)
        if impl not in self.impls:
            raise ConfigError(f"{where}: impl {impl!r} is not one of {', '.join(self.impls)}")
        formats, only_arch = self.impls[impl]
        if (formats and fmt not in formats) or (only_arch and arch != only_arch):
            raise ConfigError(f"{where}: impl {impl!r} serves {' and '.join(formats)} entries "
                              f"of arch {only_arch}, not format {fmt!r} of arch {arch!r}")
        allowed = {k.name: k for k in self.keys_of(fmt, impl)}
        for name, value in entry["meta"].items():
            if name not in allowed:
                raise ConfigError(f"{where}: meta key {name!r} is not in the {self.table} "
                                  f"schema for format {fmt!r}, impl {impl!r} (keys: "
                                  f"{', '.join(allowed)})")
            key = allowed[name]
            _check_value(key, value, where, "meta")
            if key.only_on and value != key.default and (
                    backend is None or not takes(key.only_on, backend, arch)):
                raise ConfigError(f"{where}: meta key {name!r} = {value} needs a {key.only_on} "
                                  f"device; arch {arch!r} may not be one")
        for key in LAUNCH_KEYS:
            if key.name in entry:
                _check_value(key, entry[key.name], where, "launch")
        amd = entry.get("amd", {})
        if not isinstance(amd, dict):
            raise ConfigError(f"{where}: 'amd' is a mapping of AMD launch keys")
        if amd and backend == "cuda":
            raise ConfigError(f"{where}: AMD launch keys {sorted(amd)} in NVIDIA arch {arch!r}")
        by_name = {k.name: k for k in AMD_LAUNCH_KEYS}
        for name, value in amd.items():
            if name not in by_name:
                raise ConfigError(f"{where}: amd key {name!r} is not an AMD launch key "
                                  f"({', '.join(by_name)})")
            _check_value(by_name[name], value, where, "amd")

    def check_table(self, table: Any, where: str) -> None:
        """Every entry of a loaded table (`check_entry`), each error naming its coordinate."""
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: a table maps arch -> format -> bucket -> entry")
        for arch, by_fmt in table.items():
            for fmt, buckets in by_fmt.items():
                for bucket, entry in buckets.items():
                    at = f"{where}: arch {arch}, format {fmt}, bucket {bucket}"
                    if not str(bucket).isdigit():
                        raise ConfigError(f"{at}: a bucket is a non-negative integer")
                    self.check_entry(entry, arch, fmt, at)


def _check_value(key: Key, value: Any, where: str, part: str) -> None:
    if not key.allows(value):
        raise ConfigError(f"{where}: {part} key {key.name!r} = {value!r} is not "
                          f"{key.describe()}")


LAUNCH_KEYS = (
    Key("num_warps", SIZE, 1, 32, "warps per program (at most 1,024 threads: 16 wavefronts of "
        "64 on AMD)", default=4),
    Key("num_stages", COUNT, 1, 8, "software-pipelining stages of the kernel's loops",
        default=2),
)
# AMD launch options: they reach the launch only on HIP (NVIDIA rejects them), so a table keeps
# them under "amd", never in an NVIDIA arch's section.
AMD_LAUNCH_KEYS = (
    Key("waves_per_eu", COUNT, 0, 8, "occupancy hint, waves per execution unit (0: none)",
        default=0, only_on=HIP),
    Key("matrix_instr_nonkdim", HELD, 0, 32, "MFMA instruction size, 16 or 32 (0: the "
        "compiler's choice)", default=0, only_on=HIP),
    Key("kpack", HELD, 1, 2, "MFMA operand packing (gfx950 takes 1 only: "
        "`BlockConfig.launch_kwargs` resets it there)", default=1, only_on=HIP),
)

INDEX_FORMATS = {"bf16": "bf16", "fp8": "fp8", "mxfp4": "mxfp4"}
KV_FORMATS = {"bf16": "bf16", "fp8": "fp8"}


def _scorer_keys(*extra: Key) -> tuple[Key, ...]:
    """The launch-plan keys every index scorer has (`qsa.kernels.index_tiles.plan_tiles`) and
    its own; `split_config` takes every meta value as a power of two."""
    return (
        Key("BLOCK_N", SIZE, 16, 256, "key groups per tile (16: the smallest matrix-unit N)"),
        Key("PROGRAMS_PER_UNIT", SIZE, 1, 64, "programs per SM/CU the key chunks are sized to "
            "fill", host=True),
        Key("MAX_TILES", SIZE, 2, 256, "most key tiles one program scores", host=True),
        *extra,
    )


_ATTENTION_KEYS = (
    Key("BLOCK_N", SIZE, 16, 256, "tokens per K/V tile"),
    Key("PV_HALVES", SWITCH, 0, 1, "the PV product over each half of the head dim in turn "
        "(less shared memory for FP8 tiles' fp16 staging)", default=0, impls=("triton",)),
    Key("SLOTS", SWITCH, 0, 1, "a pre-pass turns ids into cache slots, one dependent load less "
        "in the loop, for a launch more (the shared path and the Gluon kernel always have "
        "slots)", default=0, host=True, formats=("bf16", "fp8"), impls=("triton",)),
    Key("ROWS", SIZE, 1, 8, "consecutive rows one program owns, walking the union of their "
        "selections", default=1, formats=("bf16-shared", "fp8-shared")),
    Key("SHARE_MAX_UNION", HELD, 0, 800, "largest union, in hundredths of one row's ids, at "
        "which `plan_sharing` chooses the shared path (set from the overlap suite's "
        "break-even)", default=0, host=True, formats=("bf16-shared", "fp8-shared")),
    Key("NUM_SPLITS", COUNT, 0, 64, "splits of each token list (0: from the SM/CU count where "
        "SPLIT_RESIDENT_PER_SM is set, else unsplit)", default=0, host=True),
)
_SPLIT_KEYS = (
    Key("SPLIT_RESIDENT_PER_SM", COUNT, 1, 32, "resident programs per SM/CU the split count "
        "fills in one wave (absent: unsplit)", host=True),
    Key("SPLIT_MIN_BLOCKS", COUNT, 1, 64, "fewest token blocks per split", default=1,
        host=True),
    Key("MERGE_BLOCK_D", SIZE, 16, 256, "head-dim columns per program of the split merge "
        "(absent: the head dim)", host=True),
    Key("MERGE_WARPS", SIZE, 1, 32, "warps of the split merge (absent: the attention "
        "kernel's)", host=True),
)
_SHARED_KV_FORMATS = {**KV_FORMATS, "bf16-shared": "bf16", "fp8-shared": "fp8"}
# The Gluon sparse GQA decode kernel's own keys (`qsa.kernels.sparse_gqa_gluon`).
_GLUON = ("gluon",)
_GLUON_DECODE_KEYS = (
    Key("STAGES", COUNT, 1, 8, "shared-memory stages of the load warps' ring of K/V tiles",
        impls=_GLUON),
    Key("LOAD_WARPS", SIZE, 1, 8, "warps of the load partition", impls=_GLUON),
    Key("LOAD_REGS", COUNT, 24, 256, "registers per thread of the load partition (a multiple "
        "of 8)", impls=_GLUON),
    Key("MAXNREG", COUNT, 0, 255, "registers per thread of the whole program (0: the "
        "compiler's; 128 lets two programs share an SM)", default=0, impls=_GLUON),
    Key("KW", SIZE, 2, 8, "head-dim codes per thread of the QK operands (their K-width)",
        default=8, impls=_GLUON),
    Key("SLOTS_AHEAD", SWITCH, 0, 1, "the load warps load a tile's slots while the previous "
        "tile's copies fly and hand them to the compute warps in shared memory",
        default=0, impls=_GLUON),
    Key("RESOLVE_IDS", SWITCH, 0, 1, "the load warps resolve token ids through the page table "
        "(no slots pre-pass launch; needs SLOTS_AHEAD)", default=0, impls=_GLUON),
)

SCHEMAS: dict[str, ConfigSchema] = {s.table: s for s in (
    ConfigSchema("score_stacked", INDEX_FORMATS, _scorer_keys(
        Key("HOIST_Q_MIN_TILES", SIZE, 1, 256, "tiles per program from which q is loaded once "
            "per program instead of once per tile", host=True))),
    ConfigSchema("score_rowwise", INDEX_FORMATS, _scorer_keys(
        Key("CK", SIZE, 8, 256, "head-dim elements per FMA chunk"))),
    ConfigSchema("score_prefill", INDEX_FORMATS, _scorer_keys(
        Key("BLOCK_MH", SIZE, 16, 1024, "rows x heads budget of a row tile at index dim 128",
            host=True),
        Key("DECODE_MIN_GROUPS", SIZE, 1, 1 << 17, "groups of the widest request from which "
            "FP8/MXFP4 keys are decoded once per call (absent: never)", host=True,
            formats=("fp8", "mxfp4")))),
    ConfigSchema("topk", {"fp32": "fp32", "fp32-many-rows": "fp32"}, (
        Key("CHUNK", SIZE, 1, 1 << 17, "candidates per chunk of the final selection pass"),
        Key("BOUND", SWITCH, 0, 1, "the threshold search starts below the bits every "
            "candidate for the k-th key shares", default=0, host=True),
    )),
    ConfigSchema("compress", INDEX_FORMATS, (
        Key("GROUPS", SIZE, 1, 64, "groups per tile of the persistent grid"),
        Key("PROGRAMS", COUNT, 1, 1 << 16, "programs of the persistent grid"),
    )),
    ConfigSchema("kv_quant", KV_FORMATS, (
        Key("BLOCK_R", SIZE, 1, 256, "(token, KV head) rows per program"),
    )),
    ConfigSchema("sparse_gqa_decode", _SHARED_KV_FORMATS, (
        *_ATTENTION_KEYS, *_SPLIT_KEYS,
        Key("PDL", SWITCH, 0, 1, "programmatic dependent launch of the pre-pass, attention and "
            "merge grids", default=0, host=True, formats=("bf16", "fp8"), only_on=SM90,
            impls=("triton",)),
        *_GLUON_DECODE_KEYS,
    ), impls={"triton": ((), None), "gluon": (("bf16", "fp8"), SM90)}),
    ConfigSchema("sparse_gqa_prefill", _SHARED_KV_FORMATS, _ATTENTION_KEYS),
)}


def schema_of(table: str) -> ConfigSchema:
    try:
        return SCHEMAS[table]
    except KeyError:
        raise ConfigError(f"no config schema for table {table!r} (tables: "
                          f"{', '.join(SCHEMAS)})") from None


def host_keys(*tables: str) -> tuple[str, ...]:
    """The meta keys of these tables that the wrappers read on the host, sorted."""
    return tuple(sorted({k.name for t in tables for k in schema_of(t).keys if k.host}))
