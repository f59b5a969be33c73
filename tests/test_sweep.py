"""Sweep machinery: spec checks, point naming and identity, device slots, and real papermill
runs of a tiny fixture notebook (a failing point, a killed and resumed sweep)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from qsa.workbench import notebooks as wb
from qsa.workbench import sweep as sw

FIXTURE = Path(__file__).parent / "fixtures" / "notebooks" / "sweep_point.py"
REPO = Path(__file__).resolve().parents[1]


def write_spec(tmp_path: Path, notebook: Path = FIXTURE, **fields) -> Path:
    spec = {"name": "fixture", "notebook": str(notebook), "devices": "cpu", **fields}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def markers(sweep_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text())
            for p in sorted(sweep_dir.glob(f"points/*/{sw.MARKER}"))}


# --- spec and points ---------------------------------------------------------------------------


def test_spec_rejects_unknown_parameters_and_reserved_names(tmp_path: Path) -> None:
    with pytest.raises(sw.SweepError, match=r"\['valu'\] are not parameters"):
        sw.load_spec(write_spec(tmp_path, grid={"valu": [1]}))
    with pytest.raises(sw.SweepError, match="set by the sweep"):
        sw.load_spec(write_spec(tmp_path, parameters={"results_root": "x"}))
    with pytest.raises(sw.SweepError, match="both grid dimensions and fixed"):
        sw.load_spec(write_spec(tmp_path, grid={"value": [1]}, parameters={"value": 2}))
    with pytest.raises(sw.SweepError, match="no values"):
        sw.load_spec(write_spec(tmp_path, grid={"value": []}))
    with pytest.raises(sw.SweepError, match="unknown keys"):
        sw.load_spec(write_spec(tmp_path, gird={"value": [1]}))
    with pytest.raises(sw.SweepError, match="name must match"):
        sw.load_spec(write_spec(tmp_path, name="Bad Name"))


def test_spec_needs_a_results_root_parameter(tmp_path: Path) -> None:
    nb = tmp_path / "no_root.py"
    nb.write_text(FIXTURE.read_text().replace('results_root = "profiles"\n', ""))
    with pytest.raises(sw.SweepError, match="no 'results_root' parameter"):
        sw.load_spec(write_spec(tmp_path, notebook=nb))


def test_points_are_the_grid_product_with_readable_unique_names(tmp_path: Path) -> None:
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1, 2], "fail_values": [[], [2]]},
                                   parameters={"delay_s": 0.5}))
    points = sw.expand_points(spec, tmp_path)
    assert [p.name for p in points] == [
        "value=1__fail_values=none", "value=1__fail_values=2",
        "value=2__fail_values=none", "value=2__fail_values=2"]
    assert points[3].parameters == {"delay_s": 0.5, "value": 2, "fail_values": [2]}
    assert points[3].identity["parameters"] == {"delay_s": 0.5, "fail_values": [2], "value": 2}
    assert len({p.directory for p in points}) == 4


def test_a_marker_counts_only_for_the_same_parameters_and_code(tmp_path: Path) -> None:
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1]}))
    point = sw.expand_points(spec, tmp_path)[0]
    point.directory.mkdir(parents=True)
    version = sw.code_version(spec.notebook)
    marker = sw._marker(point, version, "cpu#0", "passed")
    (point.directory / sw.MARKER).write_text(json.dumps(marker))
    assert sw.is_done(point, version)
    assert not sw.is_done(point, "another-version")
    other = sw.load_spec(write_spec(tmp_path, grid={"value": [1]}, parameters={"delay_s": 1}))
    assert not sw.is_done(sw.expand_points(other, tmp_path)[0], version)
    (point.directory / sw.MARKER).write_text(json.dumps({**marker, "status": "failed"}))
    assert not sw.is_done(point, version)


def test_code_version_follows_the_notebook_text(tmp_path: Path) -> None:
    nb = tmp_path / "nb.py"
    shutil.copy(FIXTURE, nb)
    before = sw.code_version(nb)
    assert sw.code_version(nb) == before
    nb.write_text(nb.read_text() + "\n# changed\n")
    assert sw.code_version(nb) != before


# --- device slots ------------------------------------------------------------------------------


def test_cpu_slots_hide_gpus_and_use_the_interpreter() -> None:
    slots = sw.resolve_slots("cpu", jobs=2)
    assert [s.label for s in slots] == ["cpu#0", "cpu#1"]
    for s in slots:
        assert s.env["CUDA_VISIBLE_DEVICES"] == "-1"
        assert s.env["TRITON_INTERPRET"] == "1"


def test_gpu_slots_pin_one_gpu_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw, "visible_gpus",
                        lambda: ("nvidia", "CUDA_VISIBLE_DEVICES", ["2", "5", "7"]))
    slots = sw.resolve_slots("auto")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["2", "5", "7"]
    two = sw.resolve_slots([0, 2], workers_per_device=2)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in two] == ["2", "7", "2", "7"]
    assert len(sw.resolve_slots("auto", jobs=1)) == 1
    with pytest.raises(sw.SweepError, match="not indices"):
        sw.resolve_slots([3])


def test_amd_slots_select_with_rocr_and_drop_hip_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw, "visible_gpus", lambda: ("amd", "ROCR_VISIBLE_DEVICES", ["0", "1"]))
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    slots = sw.resolve_slots("auto")
    env = sw._child_env(slots[1], {"QSA_X": "1"})
    assert env["ROCR_VISIBLE_DEVICES"] == "1" and env["QSA_X"] == "1"
    assert "HIP_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert slots[1].label == "amd:1"


def test_no_gpu_falls_back_to_cpu_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw, "visible_gpus", lambda: ("cpu", "", []))
    assert all(s.label.startswith("cpu") for s in sw.resolve_slots("auto"))


# --- real runs ---------------------------------------------------------------------------------


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, grid={"value": [1, 2, 3]}, parameters={"fail_values": [2]})
    summary = sw.run_sweep(spec, tmp_path / "out", jobs=2, progress=False)
    assert (summary.passed, summary.failed, summary.skipped) == (2, 1, 0)
    assert not summary.ok
    [failure] = summary.failures
    assert failure["point"] == "value=2"
    assert failure["ename"] == "ValueError"
    assert "deliberate failure at value=2" in failure["evalue"]
    m = markers(summary.sweep_dir)
    assert m["value=2"]["status"] == "failed"
    assert m["value=2"]["error"]["cell_index"] is not None
    assert "deliberate failure" in m["value=2"]["error"]["traceback"]
    # the failing point's executed notebook is kept, with papermill's error record
    nb = json.loads((summary.sweep_dir / "points" / "value=2" / sw.EXECUTED).read_text())
    assert nb["metadata"]["papermill"]["exception"] is True
    table = sw.load_sweep(summary.sweep_dir)
    assert sorted(table["value"]) == [1, 3]
    assert (summary.sweep_dir / "results.parquet").is_file()
    assert "FAILED value=2: ValueError" in str(summary)
    meta = json.loads((summary.sweep_dir / "sweep.json").read_text())
    assert (meta["status"], meta["passed"], meta["failed"]) == ("finished", 2, 1)

    # the design review's loader sees the passed points of sweeps under a results root
    stored, metas = wb.load_results(tmp_path / "out")
    assert sorted(stored["value"]) == [1, 3] and set(metas) == set(stored["run_id"])

    # a re-run skips the passed points and retries the failed one
    again = sw.run_sweep(spec, tmp_path / "out", jobs=2, progress=False)
    assert (again.passed, again.failed, again.skipped) == (0, 1, 2)


def test_a_killed_sweep_resumes_without_duplicates_or_losses(tmp_path: Path) -> None:
    values = [1, 2, 3, 4]
    pause = tmp_path / "pause"  # points after the first wait while it exists
    pause.touch()
    spec = write_spec(tmp_path, grid={"value": values},
                      parameters={"delay_s": 60.0, "fast_values": [1], "pause_file": str(pause)})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "sweep.py"), str(spec),
                             "--out", str(out), "--jobs", "1", "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    sweep_dir = out / "cpu-interpreter" / "sweeps" / "fixture"
    in_flight = sweep_dir / "points" / "value=2" / sw.EXECUTED  # papermill writes it first
    deadline = time.monotonic() + 60
    while not (markers(sweep_dir).get("value=1", {}).get("status") == "passed"
               and in_flight.exists()):
        assert proc.poll() is None, "the sweep ended before it could be killed"
        assert time.monotonic() < deadline, "the second point never started"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: its runner must die with it
    proc.wait()
    first = markers(sweep_dir)["value=1"]
    assert set(markers(sweep_dir)) == {"value=1"}  # value=2 was in flight: no marker
    pause.unlink()  # a surviving runner would now finish value=2 and write its marker
    time.sleep(2.5)
    assert set(markers(sweep_dir)) == {"value=1"}, "a runner outlived the killed driver"

    summary = sw.run_sweep(spec, out, jobs=2, progress=False)
    assert (summary.passed, summary.failed, summary.skipped) == (3, 0, 1)
    assert markers(sweep_dir)["value=1"] == first  # kept, not re-run
    table = sw.load_sweep(sweep_dir)
    assert sorted(table["value"]) == values  # each point exactly once
    assert table["run_id"].is_unique
    for v in values:  # one finished run per point, no half-written leftovers
        runs = list((sweep_dir / "points" / f"value={v}").glob("results/*/*/run.json"))
        assert len(runs) == 1
        assert json.loads(runs[0].read_text())["status"] == "finished"


def test_port_race_is_retried_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1]}))
    point = sw.expand_points(spec, tmp_path)[0]
    attempts = []

    class FakeProc:
        returncode = 1

        def __init__(self, *a, **k) -> None:
            attempts.append(1)
            error = ({"ename": "ZMQError", "evalue": "Address already in use"}
                     if len(attempts) == 1 else {"ename": "ValueError", "evalue": "real"})
            marker = sw._marker(point, "v", "cpu#0", "failed", error=error)
            (point.directory / sw.MARKER).write_text(json.dumps(marker))

        def wait(self, timeout: float | None = None) -> int:
            return 1

    monkeypatch.setattr(sw.subprocess, "Popen", FakeProc)
    marker = sw.run_point(point, spec, "v", sw.resolve_slots("cpu", jobs=1)[0])
    assert len(attempts) == 2
    assert marker["error"]["ename"] == "ValueError"


def test_a_runner_that_dies_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1]}))
    point = sw.expand_points(spec, tmp_path)[0]

    class DeadProc:
        returncode = -9

        def __init__(self, *a, **k) -> None:
            k["stdout"].write(b"Killed\n")

        def wait(self, timeout: float | None = None) -> int:
            return -9

    monkeypatch.setattr(sw.subprocess, "Popen", DeadProc)
    marker = sw.run_point(point, spec, "v", sw.resolve_slots("cpu", jobs=1)[0])
    assert marker["status"] == "failed"
    assert marker["error"]["ename"] == "RunnerExited"
    assert "code -9" in marker["error"]["evalue"] and "Killed" in marker["error"]["log_tail"]
    assert json.loads((point.directory / sw.MARKER).read_text()) == marker
