"""Block configs as data: per kernel, per arch, per storage format, per shape bucket. A kernel
may split a format's entries by regime under its own keys (top-k: `fp32` for decode calls,
`fp32-many-rows` for prefill chunks, `qsa.kernels.topk.MANY_ROWS`).

Tables live in `qsa/configs/tables/<kernel>.json`:
    {"<arch>": {"<format>": {"<bucket>": {"meta": {...constexprs}, "num_warps": 4,
                                          "num_stages": 2, "amd": {...}, "provenance": {...}}}}}
`arch` is "sm90", "gfx950", "gfx942", ... or "default" (used when the arch has no entry, and by
the interpreter). Buckets are integers (rows, tokens, ... as the kernel defines) and lookup
takes the nearest one. AMD-only launch keys live under "amd" and reach the launch only on the
HIP backend: NVIDIA rejects them. Every table is checked against its schema
(`qsa.configs.schema`) when it is loaded and before an entry is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from qsa.configs.schema import AMD_LAUNCH_KEYS, IMPLS, ConfigError, schema_of

TABLE_DIR = Path(__file__).with_name("tables")
AMD_KEYS = tuple(k.name for k in AMD_LAUNCH_KEYS)


@dataclass(frozen=True)
class BlockConfig:
    meta: dict[str, int]
    num_warps: int = 4
    num_stages: int = 2
    amd: dict[str, int] = field(default_factory=dict)
    impl: str = "triton"  # which implementation of the kernel runs the entry (IMPLS)

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ConfigError(f"impl: {self.impl!r} is not one of {', '.join(IMPLS)}")
        bad = set(self.amd) - set(AMD_KEYS)
        if bad:
            raise ConfigError(f"amd: unknown AMD launch keys {sorted(bad)}")
        clash = set(self.meta) & set(AMD_KEYS)
        if clash:
            raise ConfigError(f"meta: AMD-only keys {sorted(clash)} belong under 'amd'")

    def launch_kwargs(self, backend: str, arch: str = "") -> dict[str, Any]:
        """Keyword arguments for `kernel[grid](..., **kw)` on `backend` ('cuda'/'hip'/...)."""
        kw: dict[str, Any] = dict(self.meta, num_warps=self.num_warps, num_stages=self.num_stages)
        if backend == "hip":
            amd = dict(self.amd)
            if arch == "gfx950" and amd.get("kpack", 1) != 1:
                amd["kpack"] = 1  # gfx950 deprecates kpack != 1 (it would be reset with a warning)
            kw.update(amd)
        return kw

    def with_meta(self, **meta: int) -> "BlockConfig":
        return BlockConfig({**self.meta, **meta}, self.num_warps, self.num_stages, self.amd,
                           self.impl)

    def as_dict(self) -> dict[str, Any]:
        d = {"meta": dict(self.meta), "num_warps": self.num_warps,
             "num_stages": self.num_stages, "amd": dict(self.amd)}
        return d if self.impl == "triton" else {**d, "impl": self.impl}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BlockConfig":
        try:
            return cls(dict(d["meta"]), int(d.get("num_warps", 4)), int(d.get("num_stages", 2)),
                       dict(d.get("amd", {})), str(d.get("impl", "triton")))
        except (KeyError, TypeError) as e:
            raise ConfigError(f"malformed config entry {d!r}: {e}") from None


def table_path(kernel: str, table_dir: Path | None = None) -> Path:
    return (table_dir or Path(os.environ.get("QSA_CONFIG_DIR", TABLE_DIR))) / f"{kernel}.json"


@lru_cache(maxsize=None)
def _load(path: Path, mtime: float) -> dict[str, Any]:
    """The table at `path`, checked against its schema once per version of the file."""
    with open(path) as f:
        table = json.load(f)
    schema_of(path.stem).check_table(table, str(path))
    return table


def load_table(kernel: str, table_dir: Path | None = None) -> dict[str, Any]:
    path = table_path(kernel, table_dir)
    if not path.exists():
        raise ConfigError(f"no config table for kernel {kernel!r} at {path}")
    return _load(path, path.stat().st_mtime)


@dataclass(frozen=True)
class ConfigChoice:
    config: BlockConfig
    arch: str
    fmt: str
    bucket: int
    tuned: bool
    provenance: dict[str, Any]


def get_config(kernel: str, arch: str, fmt: str, size: int,
               table_dir: Path | None = None) -> ConfigChoice:
    """The entry for `arch` (falling back to "default") and `fmt` nearest to `size`."""
    table = load_table(kernel, table_dir)
    use_arch = arch if arch in table else "default"
    if use_arch not in table:
        raise ConfigError(f"{kernel}: no entry for arch {arch!r} and no 'default'")
    by_fmt = table[use_arch]
    if fmt not in by_fmt:
        raise ConfigError(f"{kernel}/{use_arch}: no entry for format {fmt!r} "
                          f"(has {', '.join(by_fmt)})")
    buckets = {int(k): v for k, v in by_fmt[fmt].items()}
    if not buckets:
        raise ConfigError(f"{kernel}/{use_arch}/{fmt}: no buckets")
    best = min(buckets, key=lambda b: (abs(b - size), b))
    entry = buckets[best]
    prov = entry.get("provenance", {})
    return ConfigChoice(BlockConfig.from_dict(entry), use_arch, fmt, best,
                        bool(prov.get("tuned", False)), prov)


def write_entry(kernel: str, arch: str, fmt: str, bucket: int, config: BlockConfig,
                provenance: dict[str, Any], table_dir: Path | None = None) -> Path:
    """Store a (tuned) entry with its provenance, checked against the table's schema; atomic
    replace of the table file."""
    path = table_path(kernel, table_dir)
    entry = {**config.as_dict(), "provenance": provenance}
    schema_of(kernel).check_entry(entry, arch, fmt,
                                  f"{path}: arch {arch}, format {fmt}, bucket {bucket}")
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(arch, {}).setdefault(fmt, {})[str(bucket)] = entry
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
