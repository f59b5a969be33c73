"""`qsa sweep --backend ray`: the points of a sweep as tasks of a Ray cluster (here a local
one the driver starts on this machine's CPUs, gone with it), with the local runner's store, markers and resume rules: a failing point is
recorded and the run goes on, and a driver killed mid-sweep is resumed with no point lost or
run twice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qsa.workbench import sweep as sw
from test_sweep import REPO, markers, sweep_meta, wait_for, write_spec

pytest.importorskip("ray", reason="the [cluster] extra (ray) is not installed")

def _sweep(spec: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qsa.cli", "sweep", str(spec), "--out",
                             str(out), "--backend", "ray", "--address", "local", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)


def _runs(sweep_dir: Path) -> dict[str, list[str]]:
    """Finished store runs per point: more than one would be a point run twice."""
    return {p.name: sorted(str(r.parent.name) for r in p.glob("results/*/*/run.json"))
            for p in sorted((sweep_dir / "points").iterdir())}


@pytest.mark.slow
def test_a_ray_sweep_records_every_point_and_its_node(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, grid={"value": [1, 2, 3]}, parameters={"fail_values": [2]})
    out = tmp_path / "out"
    proc = _sweep(spec, out)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-3000:]  # one point failed: the run went on
    sweep_dir = out.resolve() / "cpu-interpreter" / "sweeps" / "fixture"
    found = markers(sweep_dir)
    assert {k: m["status"] for k, m in found.items()} == {
        "value=1": "passed", "value=2": "failed", "value=3": "passed"}
    assert all(m["slot"].startswith("ray:") and m["slot"].endswith(":cpu")
               for m in found.values())
    assert found["value=2"]["error"]["ename"] == "ValueError"
    meta = sweep_meta(sweep_dir)
    assert (meta["backend"], meta["status"], meta["passed"], meta["failed"]) == \
        ("ray", "finished", 2, 1)
    assert (sweep_dir / "results.parquet").is_file()


@pytest.mark.slow
def test_a_killed_ray_driver_resumes_with_no_point_lost_or_run_twice(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, grid={"value": [1, 2, 3, 4]},
                      parameters={"delay_s": 8.0, "fast_values": [1]})
    out = tmp_path / "out"
    sweep_dir = out.resolve() / "cpu-interpreter" / "sweeps" / "fixture"
    proc = _sweep(spec, out)
    try:
        wait_for(lambda: "value=1" in markers(sweep_dir), proc, timeout_s=300)
        proc.send_signal(signal.SIGKILL)  # no handler runs: a lost driver
        proc.wait(timeout=60)
    finally:
        proc.kill()
    done_before = {k for k, m in markers(sweep_dir).items() if m["status"] == "passed"}
    assert "value=1" in done_before and len(done_before) < 4
    again = _sweep(spec, out)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr[-3000:]
    found = markers(sweep_dir)
    assert set(found) == {f"value={v}" for v in (1, 2, 3, 4)}
    assert all(m["status"] == "passed" for m in found.values())
    assert all(len(runs) == 1 for runs in _runs(sweep_dir).values()), _runs(sweep_dir)
    meta = sweep_meta(sweep_dir)
    assert meta["skipped"] == len(done_before) and meta["passed"] == 4 - len(done_before)
    first = json.loads((sweep_dir / "points" / "value=1" / sw.MARKER).read_text())
    assert first["finished_at"] < meta["started_at"]  # kept, not run again


@pytest.mark.slow
def test_tune_all_on_a_ray_cluster_tunes_each_coordinate_once_on_a_worker(tmp_path, monkeypatch):
    """Each point is located by a worker; each distinct coordinate is tuned as one task (its
    candidates in one process); nothing is written from interpreter timings."""
    import shutil

    from qsa.configs import TABLE_DIR
    from qsa.workbench.ops import Point
    from qsa.workbench.tune import tune_all_on_cluster
    from support import tiny_preset

    shutil.copytree(TABLE_DIR, tmp_path / "tables")
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path / "tables"))  # workers inherit it
    tiny = tiny_preset()
    points = [Point("score_stacked", tiny, 2, 160, 2), Point("score_stacked", tiny, 2, 160, 1),
              Point("kv_store", tiny, 2, 160, 2, "bf16", "fp8")]
    try:
        df = tune_all_on_cluster(points, "local", max_candidates=2, samples=1)
    finally:
        import ray

        ray.shutdown()
    assert df["status"].tolist() == ["tuned", "same coordinate as shape 0", "tuned"]
    assert (df.loc[[0, 2], "candidates"] == 2).all() and df.loc[0, "node"] == "cpu"
    assert set(df["arch"]) == {"default"}  # the workers ran the interpreter
