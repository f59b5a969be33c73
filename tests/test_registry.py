"""The op registry and the config schemas hold together: every op has its kernel, reference,
test, smoke point and table; every key of every table entry is in its op's schema and within
its allowed values; no schema switch is one that no entry turns on; the tuner searches only an
op's own keys; and a table outside its schema is refused by name. The checks over tables take
a table folder, and each is shown failing on a tampered copy."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from qsa.configs import TABLE_DIR, BlockConfig, ConfigError, get_config, load_table, write_entry
from qsa.configs.schema import HELD, SCHEMAS, SWITCH, schema_of, takes
from qsa.presets import get_preset
from qsa.workbench import tune
from qsa.workbench.registry import OPS, REGISTRY, OpSpec, Point, Ref, find
from qsa.workbench.suites import load_suite, smoke_points

ROOT = Path(__file__).resolve().parents[1]
# (backend, arch) the tuner's space is checked on: sm90 takes every switch, gfx950 the AMD
# launch keys, the interpreter neither.
DEVICES = (("cuda", "sm90"), ("hip", "gfx950"), ("interpreter", "default"))


def _entries(table_dir: Path) -> Iterator[tuple[str, str, str, str, dict]]:
    """(table, arch, format, bucket, entry) of every table in the folder, read as JSON (not
    through `load_table`, which refuses what these tests look for)."""
    for path in sorted(table_dir.glob("*.json")):
        for arch, by_fmt in json.loads(path.read_text()).items():
            for fmt, buckets in by_fmt.items():
                for bucket, entry in buckets.items():
                    yield path.stem, arch, fmt, bucket, entry


def _schema_problems(table_dir: Path) -> list[str]:
    """Each entry that breaks its table's schema, or leaves out a key its format needs (a key
    with no default), named by its coordinate."""
    problems = []
    for table, arch, fmt, bucket, entry in _entries(table_dir):
        where = f"{table} {arch}/{fmt}/{bucket}"
        try:
            schema = schema_of(table)
            schema.check_entry(entry, arch, fmt, where)
        except ConfigError as e:
            problems.append(str(e))
            continue
        problems += [f"{where}: sets no {k.name}"
                     for k in schema.keys_of(fmt, entry.get("impl", "triton"))
                     if k.default is None and k.name not in entry["meta"]]
    return problems


def _unused_switches(table_dir: Path) -> list[str]:
    """Schema switches no table entry turns on: a variant nothing runs."""
    on = {(table, k) for table, _, _, _, entry in _entries(table_dir)
          for k, v in entry["meta"].items() if v == 1}
    return [f"{s.table}.{k.name}" for s in SCHEMAS.values() for k in s.keys
            if k.kind == SWITCH and (s.table, k.name) not in on]


@pytest.fixture
def tables(tmp_path: Path) -> Path:
    """A copy of the shipped tables to tamper with."""
    return Path(shutil.copytree(TABLE_DIR, tmp_path / "tables"))


def _edit(tables: Path, table: str, change: Callable[[dict], Any]) -> None:
    path = tables / f"{table}.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _op_problems(spec: OpSpec) -> list[str]:
    """What an op's spec lacks: a kernel wrapper, reference and work model named below the
    registry, a test module that calls the wrapper, smoke points, a table with a schema."""
    problems = []
    named = {"entry": (spec.entry, "qsa.kernels."), "work": (spec.work, "qsa.kernels."),
             "reference": (spec.reference, "qsa.reference."),
             "table_format": (spec.table_format, "qsa.kernels."),
             "step.chosen": (spec.step and spec.step.chosen, "qsa.kernels."),
             **{f"forced {f.label}": (f.env, "qsa.kernels.") for f in spec.forced}}
    for what, (ref, below) in named.items():
        if ref and not (ref.module.startswith(below) and ref.resolve() is not None):
            problems.append(f"{spec.name}: {what} {ref} is not in {below}")
    for what in ("entry", "reference", "work"):
        if not callable(getattr(spec, what).resolve()):
            problems.append(f"{spec.name}: {what} is not a function")
    test = ROOT / spec.test
    if not test.is_file() or spec.entry.name not in test.read_text():
        problems.append(f"{spec.name}: {spec.test} does not call {spec.entry.name}")
    if not spec.smoke:
        problems.append(f"{spec.name}: no smoke points")
    if not (TABLE_DIR / f"{spec.table}.json").is_file() or spec.table not in SCHEMAS:
        problems.append(f"{spec.name}: no table {spec.table} with a schema")
    problems += [f"{spec.name}: forced path {f.label} is gated by {f.key}, which no format "
                 "carries" for f in spec.forced if not spec.schema.key(f.key).formats]
    return problems


@pytest.mark.parametrize("spec", REGISTRY, ids=OPS)
def test_every_op_has_its_kernel_reference_test_smoke_point_and_table(spec):
    assert _op_problems(spec) == []


def test_an_op_without_its_reference_test_or_smoke_points_is_named():
    bad = dataclasses.replace(find("kv_store"), reference=Ref("qsa.kernels.kv_quant", "work"),
                              test="tests/test_arena.py", smoke=())
    assert _op_problems(bad) == [
        "kv_store: reference qsa.kernels.kv_quant.work is not in qsa.reference.",
        "kv_store: tests/test_arena.py does not call store_kv",
        "kv_store: no smoke points"]


def test_the_registry_tables_and_schemas_are_the_same_set():
    assert len(set(OPS)) == len(OPS)
    tables = {p.stem for p in TABLE_DIR.glob("*.json")}
    assert tables == set(SCHEMAS) == {s.table for s in REGISTRY}


def test_the_smoke_suite_runs_every_ops_smoke_points():
    points = list(load_suite("smoke").points)
    assert points == smoke_points() and {p["op"] for p in points} == set(OPS)


def test_every_table_entry_holds_to_its_schema():
    assert _schema_problems(TABLE_DIR) == []
    for table in SCHEMAS:
        load_table(table)  # what every lookup does: the whole table checked


@pytest.mark.parametrize(("table", "arch", "fmt", "bucket", "meta", "message"), [
    ("sparse_gqa_decode", "sm90", "fp8", "256", {"BLOCK_Q": 32},
     "meta key 'BLOCK_Q' is not in the sparse_gqa_decode schema for format 'fp8'"),
    ("sparse_gqa_decode", "sm90", "fp8", "256", {"ROWS": 4},
     "meta key 'ROWS' is not in the sparse_gqa_decode schema for format 'fp8'"),
    ("score_stacked", "default", "bf16", "2048", {"BLOCK_N": 24},
     "meta key 'BLOCK_N' = 24 is not a power of two in 16..256"),
    ("topk", "sm90", "fp32", "2048", {"BOUND": 2}, "meta key 'BOUND' = 2 is not 0 or 1"),
    ("sparse_gqa_decode", "gfx950", "fp8", "1", {"PDL": 1},
     "meta key 'PDL' = 1 needs a sm90 device; arch 'gfx950' may not be one"),
    ("sparse_gqa_decode", "default", "bf16", "1", {"PDL": 1},
     "meta key 'PDL' = 1 needs a sm90 device; arch 'default' may not be one"),
])
def test_a_table_outside_its_schema_is_refused_naming_table_arch_format_bucket_and_key(
        tables, monkeypatch, table, arch, fmt, bucket, meta, message):
    _edit(tables, table, lambda t: t[arch][fmt][bucket]["meta"].update(meta))
    where = f"{table}.json: arch {arch}, format {fmt}, bucket {bucket}: "
    with pytest.raises(ConfigError, match=re.escape(where + message)):
        get_config(table, arch, fmt, int(bucket), table_dir=tables)
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tables))
    with pytest.raises(ConfigError, match=re.escape(where + message)):
        load_table(table)
    (problem,) = _schema_problems(tables)
    assert message in problem and f"{table} {arch}/{fmt}/{bucket}" in problem


def test_the_kernels_own_lookup_refuses_a_table_outside_its_schema(tables, monkeypatch):
    from qsa.kernels.common import lookup

    _edit(tables, "kv_quant", lambda t: t["default"]["fp8"]["1"]["meta"].update(BLOCK_Q=2))
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tables))
    with pytest.raises(ConfigError, match="meta key 'BLOCK_Q' is not in the kv_quant schema"):
        lookup("kv_quant", "fp8", 1)


def test_launch_keys_an_unknown_format_and_missing_keys_are_refused(tables):
    _edit(tables, "compress", lambda t: t["sm90"]["bf16"]["256"].update(
        amd={"waves_per_eu": 2}))
    _edit(tables, "kv_quant", lambda t: t["default"].update(fp16=t["default"]["bf16"]))
    _edit(tables, "topk", lambda t: t["default"]["fp32"]["2048"]["meta"].pop("CHUNK"))
    _edit(tables, "score_rowwise", lambda t: t["default"]["bf16"]["8192"].update(num_warps=3))
    problems = "\n".join(_schema_problems(tables))
    assert "compress sm90/bf16/256: AMD launch keys ['waves_per_eu'] in NVIDIA arch" in problems
    assert "kv_quant default/fp16/1: format 'fp16' is not one of bf16, fp8" in problems
    assert "topk default/fp32/2048: sets no CHUNK" in problems
    assert "score_rowwise default/bf16/8192: launch key 'num_warps' = 3" in problems


def test_write_entry_refuses_a_key_outside_the_schema_and_leaves_the_table(tables):
    before = (tables / "topk.json").read_text()
    cfg = BlockConfig({"CHUNK": 1024, "RADIX_BITS": 8})
    with pytest.raises(ConfigError, match=r"topk.json: arch sm90, format fp32, bucket 64: "
                                          r"meta key 'RADIX_BITS' is not in the topk schema"):
        write_entry("topk", "sm90", "fp32", 64, cfg, {"tuned": False}, table_dir=tables)
    assert (tables / "topk.json").read_text() == before


def test_every_schema_switch_is_turned_on_by_some_table_entry(tables):
    """A switch that no entry turns on is a variant nothing runs: it leaves the schema (and
    the kernel keeps no code for it)."""
    assert _unused_switches(TABLE_DIR) == []

    def slots_off(t: dict) -> None:
        for by_fmt in t.values():
            for buckets in by_fmt.values():
                for entry in buckets.values():
                    if "SLOTS" in entry["meta"]:
                        entry["meta"]["SLOTS"] = 0

    for table in ("sparse_gqa_decode", "sparse_gqa_prefill"):
        _edit(tables, table, slots_off)
    assert _unused_switches(tables) == ["sparse_gqa_decode.SLOTS", "sparse_gqa_prefill.SLOTS"]


def test_the_kernels_table_formats_and_host_keys_are_their_schemas():
    from qsa.kernels import sparse_gqa, topk

    assert {topk.FORMAT, topk.FORMAT_MANY_ROWS} == set(SCHEMAS["topk"].formats)
    for kernel in (sparse_gqa.KERNEL_DECODE, sparse_gqa.KERNEL_PREFILL):
        schema = SCHEMAS[kernel]
        assert {sparse_gqa.table_format(kv, shared) for kv in ("bf16", "fp8")
                for shared in (False, True)} == set(schema.formats)
        host = {k.name for k in schema.keys if k.host}
        assert host <= set(sparse_gqa._HOST_KEYS)
        assert not {k.name for k in schema.keys if not k.host} & set(sparse_gqa._HOST_KEYS)


@pytest.mark.parametrize("spec", REGISTRY, ids=OPS)
def test_every_table_format_serves_a_storage_format_the_op_reads(spec):
    """A point's table formats (what the compile check compiles) cover the whole table."""
    preset = get_preset()
    covered = {f for idx in ("bf16", "fp8", "mxfp4") for kv in ("bf16", "fp8")
               for f in Point(spec.name, preset, 1, 64, 1, idx, kv).table_formats}
    assert covered == set(spec.schema.formats)


def _space_problems(spec: OpSpec) -> list[str]:
    """Candidates of the tuner's space that change a key outside the op's schema for the
    entry's format, one the device can not take or the tuner holds, to a value the schema
    does not allow, or AMD launch keys off HIP; around each default entry of the op's table
    and on each device."""
    problems = []
    for fmt, buckets in load_table(spec.table)["default"].items():
        base = BlockConfig.from_dict(next(iter(buckets.values())))
        keys = {k.name: k for k in spec.schema.keys_of(fmt)}
        for backend, arch in DEVICES:
            space = tune.config_space(spec.name, base, backend, 64, arch)
            if space[0] != base or len(space) < 2:
                problems.append(f"{spec.name} {fmt} on {arch}: no space around the entry")
            for cand in space:
                for name, v in cand.meta.items():
                    key = keys.get(name)
                    if v != base.meta.get(name) and not (
                            key and key.kind != HELD and takes(key.only_on, backend, arch)
                            and key.allows(v)):
                        problems.append(f"{spec.name} {fmt} on {arch}: {name} = {v}")
                if cand.amd and backend != "hip":
                    problems.append(f"{spec.name} {fmt} on {arch}: amd {cand.amd}")
    return problems


@pytest.mark.parametrize("spec", REGISTRY, ids=OPS)
def test_the_tuners_space_for_an_op_varies_only_that_ops_schema_keys(spec):
    assert _space_problems(spec) == []


def test_a_space_that_tries_a_key_the_device_can_not_take_is_named(monkeypatch):
    monkeypatch.setattr(tune, "takes", lambda only_on, backend, arch: True)
    problems = _space_problems(find("sparse_gqa_decode"))
    assert "sparse_gqa_decode bf16 on gfx950: PDL = 1" in problems
    assert "sparse_gqa_decode bf16 on sm90: PDL = 1" not in problems


def test_the_registry_loads_without_torch_or_triton():
    """The CLI reads it before it decides whether kernels run under Triton's interpreter."""
    code = ("import sys, qsa.workbench.registry, qsa.cli; "
            "print(sorted(m for m in ('torch', 'triton', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_an_unknown_op_is_refused_naming_the_ops():
    with pytest.raises(ValueError, match="op: 'nope' is not one of " + ", ".join(OPS)):
        find("nope")
