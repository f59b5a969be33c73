"""Sweep machinery: spec checks, point naming and identity, device slots, stored-file digests,
the one-writer lock, and real papermill runs of a tiny fixture notebook (a failing point, a
killed, interrupted or terminated sweep resumed, damaged points measured again)."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import yaml

from qsa.measure.results import start_run
from qsa.workbench import notebooks as wb
from qsa.workbench import sweep as sw
from qsa.workbench import sweep_point as sp
from support import FakeDevice

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


def sweep_meta(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / sw.SWEEP_META).read_text())


def resume_line(spec: Path, out: Path, jobs: int) -> str:
    return f"qsa sweep {spec.resolve()} --out {out.resolve()} --jobs {jobs}"


def passed_point(point: sw.SweepPoint, version: str) -> None:
    """A point as its runner leaves it after passing (results, manifest, then marker), without
    running a notebook."""
    with start_run("sweep-fixture", root=point.directory / sw.RESULTS_DIR,
                   device=FakeDevice("test-device", "test device")) as run:
        run.add({"op": "fixture", "value": point.parameters["value"], "us": 1.0})
    digest = sp.write_manifest(point.directory)
    marker = sp._marker(point, version, "cpu#0", "passed", manifest_sha256=digest)
    (point.directory / sw.MARKER).write_text(json.dumps(marker))


def results_file(point_dir: Path) -> Path:
    [path] = point_dir.glob("results/*/*/results.parquet")
    return path


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen | None = None,
             timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc is None or proc.poll() is None, "the sweep ended before the test could act"
        assert time.monotonic() < deadline, "the sweep never got there"
        time.sleep(0.05)


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
    passed_point(point, "v1")
    assert sw.points_to_run([point], "v1", resume=True) == ([], {})
    assert sw.points_to_run([point], "v1", resume=False) == ([point], {})
    assert sw.points_to_run([point], "another-version", resume=True) == ([point], {})
    other = sw.load_spec(write_spec(tmp_path, grid={"value": [1]}, parameters={"delay_s": 1}))
    other_point = sw.expand_points(other, tmp_path)[0]
    assert sw.points_to_run([other_point], "v1", resume=True) == ([other_point], {})
    marker = json.loads((point.directory / sw.MARKER).read_text())
    (point.directory / sw.MARKER).write_text(json.dumps({**marker, "status": "failed"}))
    assert sw.points_to_run([point], "v1", resume=True) == ([point], {})


def _flip_a_byte(point_dir: Path) -> None:
    path = results_file(point_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(point_dir: Path) -> None:
    path = results_file(point_dir)
    path.write_bytes(path.read_bytes()[:100])


def _copy_the_run(point_dir: Path) -> None:  # what a second writer into the point leaves
    run = results_file(point_dir).parent
    shutil.copytree(run, run.with_name(run.name + "-again"))


DAMAGE = {
    "byte-flipped": (_flip_a_byte, "results.parquet is corrupt"),
    "truncated": (_truncate, "results.parquet is truncated (100 of "),
    "file-missing": (lambda d: results_file(d).unlink(), "results.parquet is missing"),
    "manifest-missing": (lambda d: (d / sp.MANIFEST).unlink(), "manifest.json is missing"),
    "manifest-changed": (lambda d: (d / sp.MANIFEST).write_text('{"files": {}}'),
                         "manifest.json is corrupt"),
    "marker-unreadable": (lambda d: (d / sw.MARKER).write_bytes(b"\xff{"),
                          "point.json is unreadable"),
    "second-run": (_copy_the_run, "files not written by the point's run"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_point_is_run_again_and_never_loaded(tmp_path: Path, case: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    damage, reason = DAMAGE[case]
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1, 2]}))
    intact, damaged = sw.expand_points(spec, tmp_path)
    for point in (intact, damaged):
        passed_point(point, "v1")
    damage(damaged.directory)
    todo, why = sw.points_to_run([intact, damaged], "v1", resume=True)
    assert todo == [damaged] and list(why) == [damaged.name]
    assert reason in why[damaged.name]
    assert f"sweep point {damaged.name}: " in caplog.text and reason in caplog.text
    caplog.clear()
    table = sw.load_sweep(tmp_path)  # leaves the damaged point out, never raises
    assert table["sweep_point"].tolist() == [intact.name]
    assert reason in caplog.text


def test_points_recorded_before_digests_still_load(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1]}))
    [point] = sw.expand_points(spec, tmp_path)
    passed_point(point, "v1")
    marker = json.loads((point.directory / sw.MARKER).read_text())
    del marker["manifest_sha256"]
    (point.directory / sw.MARKER).write_text(json.dumps(marker))
    assert sw.load_sweep(tmp_path)["value"].tolist() == [1]
    assert "1 passed point(s) predate file digests and are loaded unverified" in caplog.text
    todo, why = sw.points_to_run([point], "v1", resume=True)  # a sweep measures it again
    assert todo == [point] and "records no file digests" in why[point.name]


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
    env = sp._child_env(slots[1], {"QSA_X": "1"})
    assert env["ROCR_VISIBLE_DEVICES"] == "1" and env["QSA_X"] == "1"
    assert "HIP_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert slots[1].label == "amd:1"


def test_no_gpu_falls_back_to_cpu_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw, "visible_gpus", lambda: ("cpu", "", []))
    assert all(s.label.startswith("cpu") for s in sw.resolve_slots("auto"))


# --- real runs ---------------------------------------------------------------------------------


@pytest.mark.slow
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
    nb = json.loads((summary.sweep_dir / "points" / "value=2" / sp.EXECUTED).read_text())
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


@pytest.mark.slow
def test_damaged_results_are_measured_again_not_shown(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    spec = write_spec(tmp_path, grid={"value": [2, 3]})
    first = sw.run_sweep(spec, tmp_path / "out", jobs=2, progress=False)
    assert (first.passed, first.failed) == (2, 0)
    points = first.sweep_dir / "points"
    # One flipped byte in the stored 30.0 of value=3: the file still reads, with a forged number.
    forged = results_file(points / "value=3")
    data = bytearray(forged.read_bytes())
    at = data.find(struct.pack("<d", 30.0))
    data[at + 7] ^= 0x01
    forged.write_bytes(bytes(data))
    assert pd.read_parquet(forged)["us"].tolist() != [30.0]
    truncated = results_file(points / "value=2")
    truncated.write_bytes(truncated.read_bytes()[:-200])

    again = sw.run_sweep(spec, tmp_path / "out", jobs=2, progress=False)
    assert (again.passed, again.failed, again.skipped) == (2, 0, 0) and again.ok
    assert sorted(pd.read_parquet(again.results_path)["us"]) == [20.0, 30.0]  # re-measured
    why = sweep_meta(again.sweep_dir)["rerun_damaged"]
    assert "results.parquet is corrupt" in why["value=3"]
    assert "results.parquet is truncated" in why["value=2"]
    assert "sweep point value=3: " in caplog.text and "sweep point value=2: " in caplog.text


def test_a_second_run_into_a_held_folder_is_refused(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, grid={"value": [1]})
    out = tmp_path / "out"
    sweep_dir = (out / "cpu-interpreter" / "sweeps" / "fixture").resolve()
    sweep_dir.mkdir(parents=True)
    with sw.hold_sweep_lock(sweep_dir):
        with pytest.raises(sw.SweepLocked) as refused:
            sw.run_sweep(spec, out, jobs=1, progress=False)
    assert isinstance(refused.value, RuntimeError)
    assert str(refused.value).startswith(f"sweep folder {sweep_dir} is in use by another run "
                                         f"(PID {os.getpid()} on host {platform.node()}, since ")
    # a holder that has not written its PID yet is still a holder
    fd = os.open(sweep_dir / sw.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(sw.SweepLocked, match="has not recorded its PID yet"):
            sw.run_sweep(spec, out, jobs=1, progress=False)
    finally:
        os.close(fd)
    assert not (sweep_dir / sw.SWEEP_META).exists() and not (sweep_dir / "points").exists()


@pytest.mark.slow
def test_a_killed_sweep_resumes_without_duplicates_or_losses(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    values = [1, 2, 3, 4]
    pause = tmp_path / "pause"  # points after the first wait while it exists
    pause.touch()
    spec = write_spec(tmp_path, grid={"value": values},
                      parameters={"delay_s": 60.0, "fast_values": [1], "pause_file": str(pause)})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "qsa.cli", "sweep", str(spec), "--out",
                             str(out), "--jobs", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    sweep_dir = (out / "cpu-interpreter" / "sweeps" / "fixture").resolve()
    in_flight = sweep_dir / "points" / "value=2" / sp.EXECUTED  # papermill writes it first
    wait_for(lambda: markers(sweep_dir).get("value=1", {}).get("status") == "passed"
             and in_flight.exists(), proc)

    # a second run into the folder is refused while the first lives, and changes nothing
    with pytest.raises(sw.SweepLocked) as refused:
        sw.run_sweep(spec, out, jobs=2, progress=False)
    assert f"sweep folder {sweep_dir} is in use by another run (PID {proc.pid} on host " \
           f"{platform.node()}" in str(refused.value)
    assert sweep_meta(sweep_dir)["pid"] == proc.pid

    os.kill(proc.pid, signal.SIGKILL)  # the driver only: its runner must die with it
    proc.wait()
    assert sweep_meta(sweep_dir)["status"] == "running"  # nothing could record the kill
    first = markers(sweep_dir)["value=1"]
    assert set(markers(sweep_dir)) == {"value=1"}  # value=2 was in flight: no marker
    pause.unlink()  # a surviving runner would now finish value=2 and write its marker
    time.sleep(2.5)
    assert set(markers(sweep_dir)) == {"value=1"}, "a runner outlived the killed driver"

    summary = sw.run_sweep(spec, out, jobs=2, progress=False)
    assert (summary.passed, summary.failed, summary.skipped) == (3, 0, 1)
    assert f"(PID {proc.pid} on host {platform.node()}) ended without finishing" in caplog.text
    meta = sweep_meta(sweep_dir)
    assert meta["status"] == "finished"
    assert meta["previous_run"]["status"] == "interrupted"
    assert meta["previous_run"]["pid"] == proc.pid
    assert markers(sweep_dir)["value=1"] == first  # kept, not re-run
    table = sw.load_sweep(sweep_dir)
    assert sorted(table["value"]) == values  # each point exactly once
    assert table["run_id"].is_unique
    for v in values:  # one finished run per point, no half-written leftovers
        runs = list((sweep_dir / "points" / f"value={v}").glob("results/*/*/run.json"))
        assert len(runs) == 1
        assert json.loads(runs[0].read_text())["status"] == "finished"


def _paused_sweep(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """A one-point sweep whose point waits while the pause file exists: (pause file, spec,
    results root, sweep folder)."""
    pause = tmp_path / "pause"
    pause.touch()
    spec = write_spec(tmp_path, grid={"value": [1]},
                      parameters={"delay_s": 60.0, "pause_file": str(pause)})
    out = tmp_path / "out"
    return pause, spec, out, (out / "cpu-interpreter" / "sweeps" / "fixture").resolve()


def test_ctrl_c_records_interrupted_and_prints_the_resume_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pause, spec, out, sweep_dir = _paused_sweep(tmp_path)
    started = sweep_dir / "points" / "value=1" / sp.PARAMS
    sigterm_handler = signal.getsignal(signal.SIGTERM)
    done = threading.Event()

    def press_ctrl_c() -> None:
        while not (started.exists() or done.is_set()):
            time.sleep(0.05)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sw.run_sweep(spec, out, jobs=1, progress=False)
    finally:
        done.set()
    meta = sweep_meta(sweep_dir)
    assert (meta["status"], meta["stopped_by"]) == ("interrupted", "KeyboardInterrupt")
    assert f"Resume with:\n  {resume_line(spec, out, 1)}\n" in capsys.readouterr().err
    assert markers(sweep_dir) == {}  # stopped by the sweep, not recorded as a failure
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler

    pause.unlink()
    summary = sw.run_sweep(spec, out, jobs=1, progress=False)  # what the printed command does
    assert (summary.passed, summary.skipped) == (1, 0)
    assert sweep_meta(sweep_dir)["status"] == "finished"


def test_sigterm_records_interrupted_and_prints_the_resume_command(tmp_path: Path) -> None:
    pause, spec, out, sweep_dir = _paused_sweep(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "qsa.cli", "sweep", str(spec), "--out",
                             str(out), "--jobs", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for(lambda: (sweep_dir / "points" / "value=1" / sp.PARAMS).exists(), proc)
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0
    meta = sweep_meta(sweep_dir)
    assert (meta["status"], meta["stopped_by"]) == ("interrupted", "SIGTERM")
    assert f"Resume with:\n  {resume_line(spec, out, 1)}\n" in err
    assert markers(sweep_dir) == {}


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
            marker = sp._marker(point, "v", "cpu#0", "failed", error=error)
            (point.directory / sw.MARKER).write_text(json.dumps(marker))

        def wait(self, timeout: float | None = None) -> int:
            return 1

    monkeypatch.setattr(sp.subprocess, "Popen", FakeProc)
    marker = sp.run_point(point, spec, "v", sw.resolve_slots("cpu", jobs=1)[0])
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

    monkeypatch.setattr(sp.subprocess, "Popen", DeadProc)
    marker = sp.run_point(point, spec, "v", sw.resolve_slots("cpu", jobs=1)[0])
    assert marker["status"] == "failed"
    assert marker["error"]["ename"] == "RunnerExited"
    assert "code -9" in marker["error"]["evalue"] and "Killed" in marker["error"]["log_tail"]
    assert json.loads((point.directory / sw.MARKER).read_text()) == marker


# --- the table holds the spec's points only -----------------------------------------------------


def test_a_copied_point_and_points_dropped_from_the_grid_stay_out_of_the_table(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`cp -r points/<p> points/<p>.bak` and a resume: the copy is reported, not counted (it
    held the same run id, so the table had that point twice). Narrowing the grid leaves the
    dropped point's folder alone and out of the table; widening it again resumes the point
    from its folder without measuring it again."""
    out = tmp_path / "out"
    spec = write_spec(tmp_path, grid={"value": [1, 2]})
    first = sw.run_sweep(spec, out, jobs=2, progress=False)
    points = first.sweep_dir / "points"
    shutil.copytree(points / "value=1", points / "value=1.bak")

    again = sw.run_sweep(spec, out, jobs=2, progress=False)
    assert (again.passed, again.skipped) == (0, 2)
    assert again.left_out == {"value=1.bak": "not a point of the sweep's spec"}
    assert "NOT IN THE TABLE points/value=1.bak: not a point of the sweep's spec" in str(again)
    assert sweep_meta(again.sweep_dir)["left_out"] == again.left_out
    assert "left out of the table: value=1.bak (not a point of the sweep's spec)" in caplog.text
    for table in (pd.read_parquet(again.results_path), sw.load_sweep(again.sweep_dir)):
        assert table["sweep_point"].tolist() == ["value=1", "value=2"]
        assert table["run_id"].is_unique

    write_spec(tmp_path, grid={"value": [1]})  # narrowed
    narrow = sw.run_sweep(spec, out, jobs=2, progress=False)
    assert (narrow.total, narrow.skipped) == (1, 1)
    assert set(narrow.left_out) == {"value=1.bak", "value=2"}
    assert pd.read_parquet(narrow.results_path)["value"].tolist() == [1]
    assert sw.load_sweep(narrow.sweep_dir)["value"].tolist() == [1]
    assert sw.read_marker(points / "value=2")["status"] == "passed"  # kept on disk

    write_spec(tmp_path, grid={"value": [1, 2]})  # widened again
    wide = sw.run_sweep(spec, out, jobs=2, progress=False)
    assert (wide.passed, wide.skipped) == (0, 2)
    assert sorted(pd.read_parquet(wide.results_path)["value"]) == [1, 2]


def test_a_spec_point_whose_marker_is_for_other_parameters_is_left_out(tmp_path: Path) -> None:
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1, 2]}))
    one, two = sw.expand_points(spec, tmp_path)
    passed_point(one, "v1")
    passed_point(two, "v1")
    other = sw.load_spec(write_spec(tmp_path, grid={"value": [1, 2]},
                                    parameters={"delay_s": 0.5}))
    _, moved = sw.expand_points(other, tmp_path)  # same folder name, other identity
    folders, left_out = sw.table_points(tmp_path, [one, moved])
    assert folders == [one.directory]
    assert "its marker is for other parameters" in left_out[two.name]
    assert sw.load_sweep(tmp_path, points=[one, moved])["value"].tolist() == [1]


def test_a_sweep_recorded_before_point_lists_counts_each_point_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = sw.load_spec(write_spec(tmp_path, grid={"value": [1, 2]}))
    for point in sw.expand_points(spec, tmp_path):
        passed_point(point, "v1")
    shutil.copytree(tmp_path / "points" / "value=2", tmp_path / "points" / "value=2.bak")
    (tmp_path / sw.SWEEP_META).write_text(json.dumps({"status": "finished", "points": 2}))
    table = sw.load_sweep(tmp_path)
    assert table["sweep_point"].tolist() == ["value=1", "value=2"]
    assert "records no points of its spec" in caplog.text
    assert "value=2.bak (the same point as value=2 (a copy))" in caplog.text
    # with the spec's points the copy is simply not a point
    assert sw.table_points(tmp_path, sw.expand_points(spec, tmp_path))[1] == {
        "value=2.bak": "not a point of the sweep's spec"}


def test_a_grid_value_listed_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sw.SweepError, match="grid dimension 'value' lists 2 twice: that point "
                                            "would run and count twice"):
        sw.load_spec(write_spec(tmp_path, grid={"value": [1, 2, 2]}))
    assert len(sw.expand_points(sw.load_spec(write_spec(tmp_path, grid={"value": [1, 1.5]})),
                                tmp_path)) == 2


def test_an_empty_table_removes_the_table_of_an_earlier_run(tmp_path: Path) -> None:
    for name in ("results.parquet", "results.csv"):
        (tmp_path / name).write_text("stale")
    assert sw._write_table(pd.DataFrame(), tmp_path) is None
    assert not (tmp_path / "results.parquet").exists() and not (tmp_path / "results.csv").exists()
