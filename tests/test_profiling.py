"""qsa.profiling: parsers checked against real H200 outputs and built rocprofv3 fixtures.

Expected numbers come from the fixture files themselves (see tests/fixtures/profilers/README.md).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pandas as pd
import pytest

from qsa.profiling import (
    IncompleteProfileWarning,
    KernelAggregate,
    KernelLaunch,
    ProfilerConflictError,
    ProfilerUnavailableError,
    capture,
    capture_backend_available,
    capture_proton,
    capture_torch_profiler,
    launches_from_events,
    parse_kineto_trace,
    parse_proton_trace,
    parse_proton_tree,
    read_kernel_trace_csv,
    read_kineto_trace,
    read_marker_ranges,
    read_proton_trace,
    read_proton_tree,
    read_rocpd,
    read_rocprof_output,
    rocprof,
    rocprofv3_command,
    roctx_profiler,
    roctx_range,
    summarize,
    to_frame,
)
from qsa.profiling.records import RegionIndex, us_to_ns

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
PROFILERS = FIXTURES / "profilers"
GEMV = "gemv_BN64_BK128"


def _load_rocpd_fixture() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("rocpd_fixture", FIXTURES / "rocpd_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rf = _load_rocpd_fixture()


# --- records -------------------------------------------------------------------------------


def _launch(name: str, dur_us: float, region: str | None = None, start_ns: int = 0) -> KernelLaunch:
    return KernelLaunch(name, start_ns, us_to_ns(dur_us), 0, 7, region, "test")


def test_summarize_statistics_per_name_and_region():
    launches = [_launch("k", d) for d in (50, 10, 40, 20, 30)] + [_launch("k", 100, region="step0")]
    launches.append(_launch("other", 1.5))
    frame = summarize(launches)
    assert list(frame.columns) == ["name", "region", "count", "total_us", "mean_us", "median_us", "p10_us", "p90_us"]
    assert frame["total_us"].tolist() == [150.0, 100.0, 1.5]  # sorted by total, largest first
    row = frame.iloc[0]
    assert (row["name"], row["region"], row["count"]) == ("k", None, 5)
    assert row["mean_us"] == pytest.approx(30.0)
    assert row["median_us"] == pytest.approx(30.0)
    assert row["p10_us"] == pytest.approx(14.0)  # linear interpolation between 10 and 20
    assert row["p90_us"] == pytest.approx(46.0)
    assert frame.iloc[1]["region"] == "step0"
    assert frame.iloc[1]["count"] == 1


def test_summarize_aggregates_and_rejects_mixing():
    aggs = [
        KernelAggregate("k", "s", 0, 4, 40_000, "test"),
        KernelAggregate("k", "s", 0, 6, 80_000, "test"),
    ]
    frame = summarize(aggs)
    assert frame.iloc[0]["count"] == 10
    assert frame.iloc[0]["total_us"] == pytest.approx(120.0)
    assert frame.iloc[0]["mean_us"] == pytest.approx(12.0)
    assert math.isnan(frame.iloc[0]["median_us"])
    with pytest.raises(ValueError, match="separately"):
        summarize([aggs[0], _launch("k", 1.0)])
    with pytest.raises(TypeError, match="dict"):
        summarize([{"name": "k"}])


def test_summarize_empty_and_to_frame():
    assert summarize([]).empty
    frame = to_frame([_launch("k", 2.0, region=None), _launch("k", 3.0, region="r")])
    assert frame["duration_ns"].tolist() == [2000, 3000]
    assert frame["region"].tolist() == [None, "r"]


def test_us_to_ns_is_exact_where_float_math_is_not():
    assert int(1.001 * 1000) == 1000  # the float pitfall the helper avoids
    assert us_to_ns(1.001) == 1001
    assert us_to_ns(5224623040145.298) == 5224623040145298


def test_region_index_innermost_same_lane():
    index = RegionIndex(
        [
            (0, 100, 1000, "outer"),
            (0, 200, 300, "inner"),
            (0, 200, 250, "innermost_same_start"),
            (1, 150, 900, "other_lane"),
        ]
    )
    assert len(index) == 4
    assert index.innermost(0, 210, 240) == "innermost_same_start"
    assert index.innermost(0, 260, 290) == "inner"
    assert index.innermost(0, 310, 400) == "outer"
    assert index.innermost(0, 950, 1100) is None  # sticks out of every range
    assert index.innermost(1, 310, 400) == "other_lane"
    assert index.innermost(2, 310, 400) is None


# --- kineto --------------------------------------------------------------------------------


def test_kineto_fixture_kernels():
    launches = read_kineto_trace(PROFILERS / "kineto_trace_h200.json")
    assert len(launches) == 20  # the cuda_runtime/cuda_driver/ac2g events are not kernels
    assert {launch.name for launch in launches} == {GEMV}
    assert {(launch.device, launch.stream, launch.region) for launch in launches} == {(0, 7, None)}
    first = launches[0]
    assert first.start_ns == 5_224_623_040_145_298  # ts is µs although displayTimeUnit says "ms"
    assert first.duration_ns == 31_840
    assert sum(launch.duration_ns for launch in launches) == 628_992  # key_averages said 629.0 µs
    row = summarize(launches).iloc[0]
    assert row["count"] == 20
    assert row["total_us"] == pytest.approx(628.992)
    assert row["median_us"] == pytest.approx(31.424)
    assert row["p10_us"] == pytest.approx(31.36)


def test_kineto_gzip_trace_reads_the_same(tmp_path):
    gz = tmp_path / "trace.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write((PROFILERS / "kineto_trace_h200.json").read_text())
    assert read_kineto_trace(gz) == read_kineto_trace(PROFILERS / "kineto_trace_h200.json")


def _x(cat: str, name: str, ts: float, dur: float, pid: object = 0, tid: object = 7, **extra) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, **extra}


def test_kineto_gpu_user_annotation_regions():
    trace = {
        "displayTimeUnit": "ms",
        "traceEvents": [
            _x("gpu_user_annotation", "step0", 1000.0, 100.0),
            _x("gpu_user_annotation", "attn", 1010.0, 30.0),
            _x("gpu_user_annotation", "step1", 1200.0, 100.0),
            _x("gpu_user_annotation", "step_on_gpu1", 1000.0, 400.0, pid=1),
            # Device 1 range that starts inside step0 and encloses k_mlp's interval: it must
            # not claim device 0 kernels.
            _x("gpu_user_annotation", "gpu1_burst", 1060.0, 30.0, pid=1),
            _x("user_annotation", "step0", 990.0, 5.0, pid=4242, tid=4242),  # CPU side: ignored
            # ROCm-style kernel events: other args, string tid.
            _x("kernel", "k_attn", 1015.0, 10.0, args={"stream": "hip"}),
            _x("kernel", "k_mlp", 1060.5, 20.25),
            _x("kernel", "k_late", 1250.0, 5.0, tid="stream 3"),
            _x("kernel", "k_outside", 1500.0, 5.0),
            _x("kernel", "k_gpu1", 1065.0, 5.0, pid=1),
            _x("cuda_runtime", "cudaLaunchKernel", 1001.0, 3.0, pid=4242),
        ],
    }
    by_name = {launch.name: launch for launch in parse_kineto_trace(trace)}
    assert set(by_name) == {"k_attn", "k_mlp", "k_late", "k_outside", "k_gpu1"}
    assert by_name["k_attn"].region == "attn"  # innermost wins
    assert by_name["k_mlp"].region == "step0"
    assert by_name["k_mlp"].duration_ns == 20_250
    assert by_name["k_late"].region == "step1"
    assert by_name["k_late"].stream is None
    assert by_name["k_outside"].region is None
    assert by_name["k_gpu1"].region == "gpu1_burst"
    frame = summarize(list(by_name.values()))
    assert set(zip(frame["name"], frame["region"])) >= {("k_attn", "attn"), ("k_outside", None)}


def test_kineto_rejects_non_trace():
    with pytest.raises(ValueError, match="traceEvents"):
        parse_kineto_trace({"traceEvents": {"not": "a list"}})


def _fn_event(activity: str, name: str, start_us: float, end_us: float, device: int = 0, stream: int = 7):
    return types.SimpleNamespace(
        name=name,
        activity_type=activity,
        time_range=types.SimpleNamespace(start=start_us, end=end_us),
        device_index=device,
        device_resource_id=stream,
    )


def test_launches_from_live_profiler_events():
    events = [
        _fn_event("user_annotation", "step0", 0.0, 50.0, stream=4242),
        _fn_event("gpu_user_annotation", "step0", 10.0, 60.0),
        _fn_event("cpu_op", "aten::add", 1.0, 2.0),
        _fn_event("kernel", "k", 12.5, 44.0),
        _fn_event("gpu_memcpy", "Memcpy HtoD", 45.0, 46.0),
        _fn_event("kernel", "k", 70.0, 71.001),
    ]
    launches = launches_from_events(events)
    assert [(x.name, x.start_ns, x.duration_ns, x.region) for x in launches] == [
        ("k", 12_500, 31_500, "step0"),
        ("k", 70_000, 1_001, None),
    ]
    assert launches[0].stream == 7
    with pytest.raises(ValueError, match="activity_type"):
        launches_from_events([types.SimpleNamespace(name="k")])


# --- proton --------------------------------------------------------------------------------


def test_proton_tree_fixture():
    aggs = read_proton_tree(PROFILERS / "proton_tree_h200.hatchet")
    assert aggs == [KernelAggregate(GEMV, "decode_step", 0, 20, 661_919, "proton-tree")]
    assert aggs[0].mean_ns == pytest.approx(33_095.95)
    row = summarize(aggs).iloc[0]
    assert round(row["mean_us"], 1) == 33.1  # above the 31.5 µs steady state: cold launch included
    assert row["total_us"] == pytest.approx(661.919)
    assert math.isnan(row["p90_us"])


def test_proton_tree_scope_paths():
    def node(name, children=(), **metrics):
        return {"frame": {"name": name, "type": "function"}, "metrics": metrics, "children": list(children)}

    kernel = dict(count=2, device_id="1", device_type="HIP")
    tree = [
        node(
            "ROOT",
            [
                node("bare_kernel", **kernel, **{"time (ns)": 100}),
                node("decode", [node("attn", [node("k", **kernel, **{"time (ns)": 300})])], flops=1),
                node("empty_scope", bytes=5),
            ],
            count=0,
            **{"time (ns)": 0},
        ),
        {"HIP": {"1": {"arch": "gfx942"}}},
    ]
    aggs = parse_proton_tree(tree)
    assert [(a.name, a.region, a.device, a.count, a.total_ns) for a in aggs] == [
        ("bare_kernel", None, 1, 2, 100),
        ("k", "decode/attn", 1, 2, 300),
    ]
    with pytest.raises(ValueError, match="Proton tree"):
        parse_proton_tree({"frame": {}})


def test_proton_trace_fixture():
    launches = read_proton_trace(PROFILERS / "proton_trace_h200.chrome_trace")
    assert [launch.duration_ns for launch in launches] == [63_392, 31_520, 31_456]
    assert [launch.start_ns for launch in launches] == [0, 37_661_724, 37_713_211]
    assert {(launch.name, launch.stream, launch.device, launch.region) for launch in launches} == {
        (GEMV, 7, None, None)
    }
    row = summarize(launches).iloc[0]
    assert row["median_us"] == pytest.approx(31.52)
    assert row["mean_us"] == pytest.approx(126.368 / 3)


def test_proton_trace_scope_region():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "k", "ts": 2.5, "dur": 1.0, "tid": 3,
             "args": {"call_stack": ["ROOT", "step0", "attn", "k"]}},
            {"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": 1.0, "tid": 3,
             "args": {"call_stack": ["ROOT", "k"]}},
        ]
    }  # fmt: skip
    launches = parse_proton_trace(trace)
    assert [(x.start_ns, x.region) for x in launches] == [(1000, None), (2500, "step0/attn")]


# --- rocprofv3: rocpd ------------------------------------------------------------------------


EXPECTED_ROCM = {
    # (name, region): (count, total_us, median_us)
    (rf.SCORE, "decode_step0"): (2, 63.5, 31.75),
    (rf.SCORE, "decode_step1"): (2, 64.0, 32.0),
    (rf.COMBINE, "decode_step0"): (1, 12.0, 12.0),
    (rf.COMBINE, "decode_step1"): (1, 11.5, 11.5),
    (rf.FILL, None): (1, 5.0, 5.0),
}


def _check_rocm_summary(launches: list[KernelLaunch]) -> None:
    frame = summarize(launches)
    got = {(r.name, r.region): (r.count, r.total_us, r.median_us) for r in frame.itertuples()}
    assert got.keys() == EXPECTED_ROCM.keys()
    for key, (count, total, median) in EXPECTED_ROCM.items():
        assert got[key][0] == count, key
        assert got[key][1] == pytest.approx(total), key
        assert got[key][2] == pytest.approx(median), key


def test_rocpd_round_trip(tmp_path):
    (tmp_path / "host").mkdir()
    db = rf.build_rocpd_db(tmp_path / "host" / "1234_results.db")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launches = read_rocpd(db)
    assert len(launches) == len(rf.DISPATCHES) == 7
    assert [x.start_ns for x in launches] == sorted(d[2] for d in rf.DISPATCHES)
    assert {(x.device, x.stream, x.source) for x in launches} == {(rf.AGENT_ABS_INDEX, rf.STREAM_ID, "rocpd")}
    first_score = next(x for x in launches if x.name == rf.SCORE)
    assert (first_score.region, first_score.duration_ns) == ("decode_step0", 31_500)
    assert launches[0].name == rf.FILL and launches[0].region is None  # "" region -> None
    _check_rocm_summary(launches)
    # The run directory form finds the same database.
    assert read_rocprof_output(tmp_path) == launches


def test_rocpd_vanished_dispatch_is_reported(tmp_path):
    db = rf.build_rocpd_db(tmp_path / "orphan.db", orphan_dispatch=True)
    con = sqlite3.connect(db)
    counts = [con.execute(f"SELECT COUNT(*) FROM {v}").fetchone()[0] for v in ("rocpd_kernel_dispatch", "kernels")]
    con.close()
    assert counts == [8, 7]  # the fixture view really drops the dispatch without a symbol row
    with pytest.warns(IncompleteProfileWarning, match=r"8 rows.*returned 7.*dispatch 8 \(kernel_id 99\)"):
        launches = read_rocpd(db)
    assert len(launches) == 7
    _check_rocm_summary(launches)


def test_rocpd_without_kernels_view_uses_dispatch_symbol_join(tmp_path):
    db = rf.build_rocpd_db(tmp_path / "old.db", with_kernels_view=False, orphan_dispatch=True)
    with pytest.warns(IncompleteProfileWarning, match="symbol join"):
        launches = read_rocpd(db)
    _check_rocm_summary(launches)


def test_rocpd_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no rocpd database"):
        read_rocpd(tmp_path / "missing.db")
    junk = tmp_path / "junk.db"
    junk.write_text("this is not sqlite, just text long enough to fill a header" * 4)
    with pytest.raises(ValueError, match="not an SQLite database"):
        read_rocpd(junk)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(ValueError, match="not a rocpd database"):
        read_rocpd(other)


# --- rocprofv3: CSV fallback -----------------------------------------------------------------


def test_csv_fallback_with_shuffled_columns(tmp_path):
    kernel_csv, marker_csv = rf.write_rocprof_csvs(tmp_path)
    header = kernel_csv.read_text().splitlines()[0].replace('"', "").split(",")
    assert header != rf.KERNEL_TRACE_COLUMNS and sorted(header) == sorted(rf.KERNEL_TRACE_COLUMNS)
    launches = read_kernel_trace_csv(kernel_csv, marker_csv)
    assert len(launches) == 7
    assert {(x.device, x.stream, x.source) for x in launches} == {(rf.AGENT_ABS_INDEX, rf.STREAM_ID, "rocprofv3-csv")}
    # The other thread's range starts later than decode_step0 and encloses its kernels; only the
    # same-thread join keeps them in decode_step0.
    assert {x.region for x in launches if rf.T0 + 1_000_000 < x.start_ns < rf.T0 + 1_200_000} == {"decode_step0"}
    _check_rocm_summary(launches)
    # The CSV path and the rocpd path agree.
    db = rf.build_rocpd_db(tmp_path / "same.db")
    pd.testing.assert_frame_equal(summarize(launches), summarize(read_rocpd(db)))


def test_csv_without_markers_and_dir_discovery(tmp_path):
    kernel_csv, _ = rf.write_rocprof_csvs(tmp_path / "run", prefix="sweep")
    assert {x.region for x in read_kernel_trace_csv(kernel_csv)} == {None}
    # Directory and file forms pick up the sibling marker trace.
    _check_rocm_summary(read_rocprof_output(tmp_path))
    _check_rocm_summary(read_rocprof_output(kernel_csv))
    with pytest.raises(FileNotFoundError, match="no rocprofv3 output"):
        read_rocprof_output(tmp_path / "does_not_exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="kernel_trace.csv"):
        read_rocprof_output(tmp_path / "empty")


def test_marker_ranges_skip_control_and_marks(tmp_path):
    _, marker_csv = rf.write_rocprof_csvs(tmp_path)
    ranges = read_marker_ranges(marker_csv)
    assert sorted(r[3] for r in ranges) == ["decode_step0", "decode_step1", "loader_prefetch"]
    assert (rf.TID, rf.T0 + 1_000_000, rf.T0 + 1_200_000, "decode_step0") in ranges


def test_csv_missing_column_is_named(tmp_path):
    bad = tmp_path / "bad_kernel_trace.csv"
    bad.write_text('"Kind","Agent_Id","Kernel_Name","Start_Timestamp"\n"KERNEL_DISPATCH","Agent 2","k","1"\n')
    with pytest.raises(ValueError, match=r"missing column\(s\) \['End_Timestamp'\]"):
        read_kernel_trace_csv(bad)
    no_thread = tmp_path / "nothread_kernel_trace.csv"
    no_thread.write_text('"Agent_Id","Kernel_Name","Start_Timestamp","End_Timestamp"\n"GPU 3","k","1","5"\n')
    assert read_kernel_trace_csv(no_thread)[0].device == 3  # type-relative agent label
    _, marker_csv = rf.write_rocprof_csvs(tmp_path / "m")
    with pytest.raises(ValueError, match="Thread_Id"):
        read_kernel_trace_csv(no_thread, marker_csv)


# --- rocprofv3 command and ROCTx shim ---------------------------------------------------------


def test_rocprofv3_command():
    cmd = rocprofv3_command(Path("/runs/r1"), "sweep", ["python", "sweep.py", "--steps", 3])
    assert cmd == [
        "rocprofv3", "--kernel-trace", "--marker-trace", "--selected-regions", "--stats",
        "-d", "/runs/r1", "-o", "sweep", "-f", "rocpd", "--", "python", "sweep.py", "--steps", "3",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="argv is empty"):
        rocprofv3_command("/runs", "t", [])
    with pytest.raises(ValueError, match="tag"):
        rocprofv3_command("/runs", "a/b", ["python"])


@pytest.fixture
def fake_roctx(monkeypatch):
    calls: list[tuple] = []
    module = types.ModuleType("roctx")
    module.rangePush = lambda name: calls.append(("push", name))
    module.rangePop = lambda: calls.append(("pop",))
    module.profilerResume = lambda tid: calls.append(("resume", tid))
    module.profilerPause = lambda tid: calls.append(("pause", tid))
    monkeypatch.setitem(sys.modules, "roctx", module)
    rocprof._load_rocm_package.cache_clear()
    yield calls
    rocprof._load_rocm_package.cache_clear()


def test_roctx_shim_calls_the_package(fake_roctx):
    assert rocprof.roctx_unavailable_reason() is None
    with roctx_profiler():
        with roctx_range("decode_step0"):
            pass
        with pytest.raises(RuntimeError), roctx_range("decode_step1"):
            raise RuntimeError("kernel failed")
    assert fake_roctx == [
        ("resume", 0),
        ("push", "decode_step0"),
        ("pop",),
        ("push", "decode_step1"),
        ("pop",),
        ("pause", 0),
    ]


def test_roctx_shim_is_a_noop_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "roctx", None)  # makes `import roctx` raise ImportError
    rocprof._load_rocm_package.cache_clear()
    try:
        assert "roctx" in rocprof.roctx_unavailable_reason()
        with roctx_profiler(), roctx_range("step"):
            ran = True
        assert ran
    finally:
        rocprof._load_rocm_package.cache_clear()


# --- capture -------------------------------------------------------------------------------

def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


cpu_only = pytest.mark.skipif(_has_gpu(), reason="checks the no-GPU error path")


@cpu_only
def test_capture_functions_need_a_gpu(tmp_path):
    with pytest.raises(ProfilerUnavailableError, match="capture_torch_profiler needs a GPU"):
        capture_torch_profiler(lambda: None, 2, tmp_path)
    with pytest.raises(ProfilerUnavailableError, match="capture_proton needs a GPU"):
        capture_proton(lambda: None, 2, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-written
    available = capture_backend_available()
    assert set(available) == {"torch_profiler", "proton", "rocprofv3", "roctx"}
    assert "needs a GPU" in available["torch_profiler"]
    assert "needs a GPU" in available["proton"]
    assert available["rocprofv3"]  # no ROCm here


def test_capture_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        capture_torch_profiler(lambda: None, 0, tmp_path)
    with pytest.raises(ValueError, match="data"):
        capture_proton(lambda: None, 1, tmp_path, data="hatchet")


def test_capture_proton_refuses_after_torch_profiler(monkeypatch, tmp_path):
    monkeypatch.setattr(capture, "_gpu_backend", lambda what: "cuda")
    monkeypatch.setattr(capture, "_torch_profiler_ran_on_cuda", True)
    with pytest.raises(ProfilerConflictError, match="cuptiSubscribe"):
        capture_proton(lambda: None, 1, tmp_path)
    assert "cuptiSubscribe" in capture_backend_available()["proton"]


# --- GPU ----------------------------------------------------------------------------------

_TINY_KERNEL = '''
import torch
import triton
import triton.language as tl


@triton.jit(repr=lambda s: "qsa_test_add_BN%d" % s.constants["BN"])
def add_one(x_ptr, n, BN: tl.constexpr):
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def make_step():
    x = torch.zeros(4096, device="cuda")
    return lambda: add_one[(triton.cdiv(x.numel(), 128),)](x, x.numel(), BN=128)
'''


def _import_tiny_kernel(tmp_path: Path) -> types.ModuleType:
    # triton.jit needs the kernel source in a real file.
    path = tmp_path / "tiny_kernel.py"
    path.write_text(_TINY_KERNEL)
    spec = importlib.util.spec_from_file_location("tiny_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
def test_capture_torch_profiler_reports_repr_name(tmp_path):
    step = _import_tiny_kernel(tmp_path).make_step()
    launches = capture_torch_profiler(step, 3, tmp_path / "out", step_name="decode_step")
    ours = [x for x in launches if x.name == "qsa_test_add_BN128"]
    assert [x.region for x in ours] == ["decode_step0", "decode_step1", "decode_step2"]
    assert all(x.duration_ns > 0 for x in ours)
    assert (tmp_path / "out" / capture.KINETO_TRACE_NAME).is_file()


@pytest.mark.gpu
def test_capture_proton_in_fresh_process(tmp_path):
    # A fresh interpreter, because torch.profiler may already have run in this one.
    _import_tiny_kernel(tmp_path)
    script = tmp_path / "run_proton.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            sys.path.insert(0, {str(tmp_path)!r})
            from qsa.profiling import capture_proton
            import tiny_kernel
            launches = capture_proton(tiny_kernel.make_step(), 3, {str(tmp_path / "proton")!r}, data="trace")
            print(json.dumps([[x.name, x.region] for x in launches]))
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False, cwd=REPO, env=env
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [region for name, region in rows if name == "qsa_test_add_BN128"] == ["step0", "step1", "step2"]


# --- ROCm's own Python packages (fakes that follow the published APIs) ---------------------


def _rocm_site(tmp_path: Path) -> Path:
    """`<rocm>/lib/python3.X/site-packages`, where ROCm installs rocpd and roctx."""
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = tmp_path / "rocm" / "lib" / ver / "site-packages"
    site.mkdir(parents=True)
    return site


@pytest.fixture
def rocm_root(tmp_path, monkeypatch):
    site = _rocm_site(tmp_path)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "rocm"))
    for name in ("rocpd", "roctx"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    rocprof._load_rocm_package.cache_clear()
    yield site
    for name in ("rocpd", "roctx"):
        sys.modules.pop(name, None)
    if str(site) in sys.path:
        sys.path.remove(str(site))
    rocprof._load_rocm_package.cache_clear()


def test_run_databases_are_read_through_the_rocpd_package_found_under_rocm(tmp_path, rocm_root):
    """rocpd.connect([paths]) returns a RocpdImportData that answers execute() like a sqlite3
    connection (rocprofiler-sdk's rocpd README); the fake attaches the databases' rows the
    same way and records the call."""
    (rocm_root / "rocpd").mkdir()
    (rocm_root / "rocpd" / "__init__.py").write_text(
        "import sqlite3\n"
        "calls = []\n"
        "def connect(inputs):\n"
        "    calls.append(list(inputs))\n"
        "    assert isinstance(inputs, list) and len(inputs) == 1\n"
        "    return sqlite3.connect(inputs[0])\n")
    run = tmp_path / "run"
    (run / "host").mkdir(parents=True)
    db = rf.build_rocpd_db(run / "host" / "1234_results.db")
    launches = read_rocprof_output(run)
    import rocpd

    assert rocpd.calls == [[str(db.resolve())]]
    assert launches == read_rocpd(db)
    _check_rocm_summary(launches)


def test_without_rocm_packages_the_reason_names_where_they_were_looked_for(tmp_path, rocm_root):
    reason = rocprof.roctx_unavailable_reason()
    assert "roctx package not importable" in reason and str(rocm_root) in reason
    assert rocprof._load_rocm_package("rocpd")[0] is None
    # and the schema reader still reads a run
    run = tmp_path / "run"
    run.mkdir()
    db = rf.build_rocpd_db(run / "1_results.db")
    assert read_rocprof_output(run) == read_rocpd(db)


def test_a_rocprofv3_capture_is_refused_before_it_starts(tmp_path, rocm_root, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert "rocprofv3 is not on PATH" in rocprof.rocprofv3_capture_problem()
    tool = bin_dir / "rocprofv3"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    problem = rocprof.rocprofv3_capture_problem()
    assert "can not import roctx" in problem and "nothing would be captured" in problem
    (rocm_root / "roctx").mkdir()
    (rocm_root / "roctx" / "__init__.py").write_text("")
    assert rocprof.rocprofv3_capture_problem() is None  # found under ROCM_PATH by the child
    assert str(rocm_root) in rocprof.rocprof_child_env({"PYTHONPATH": "/x"})["PYTHONPATH"]
