"""Results store: round trip of runs into one DataFrame, atomic writes, recorded environment."""

import json
import os
import re
import subprocess

import pytest

from qsa.measure import results
from qsa.measure.device import cpu_device
from qsa.measure.results import (RESULTS_FILE, RUN_FILE, atomic_write_bytes, env_toggles,
                                 git_state, load_run, load_runs, new_run_id, start_run)
from qsa.measure.timing import METHOD_EVENTS, summarize_samples


def _record(shape: int, median: float) -> dict:
    t = summarize_samples([median, median + 1, median + 2], method=METHOD_EVENTS,
                          cache_policy="warm", calls_per_sample=1)
    return {"kernel": "scorer", "ctx": shape, **t.as_record()}


def test_two_runs_load_into_one_dataframe(tmp_path):
    d = cpu_device()
    a = start_run("scorer", root=tmp_path, device=d, configs=[{"BLOCK": 64}],
                  timing_method=METHOD_EVENTS, extra={"note": "a"})
    a.add(_record(1024, 10.0))
    a.add_many([_record(2048, 20.0), _record(4096, 40.0)])
    a.finish()
    b = start_run("topk", root=tmp_path, device=d)
    b.add({"kernel": "topk", "ctx": 8192, "median_us": 5.0, "extra_col": "x"})
    b.finish()

    df = load_runs(tmp_path)
    assert list(df.columns[:3]) == ["run_id", "device", "kind"]
    assert len(df) == 4
    assert sorted(set(df["run_id"])) == sorted([a.run_id, b.run_id])
    assert set(df["device"]) == {"cpu-interpreter"}
    assert df.groupby("kind").size().to_dict() == {"scorer": 3, "topk": 1}
    scorer = df[df["kind"] == "scorer"].sort_values("ctx")
    assert scorer["median_us"].tolist() == [11.0, 21.0, 41.0]
    assert list(scorer["samples_us"].iloc[0]) == [10.0, 11.0, 12.0]
    assert df.loc[df["kind"] == "topk", "extra_col"].tolist() == ["x"]

    assert load_runs(tmp_path, kind="topk")["ctx"].tolist() == [8192]
    assert len(load_runs(tmp_path, device=d)) == 4
    assert load_runs(tmp_path, device="nvidia-h200").empty
    assert list(load_runs(tmp_path / "nothing").columns) == ["run_id", "device", "kind"]

    frame, meta = load_run(a.directory)
    assert len(frame) == 3 and (frame["run_id"] == a.run_id).all()
    assert meta["configs"] == [{"BLOCK": 64}] and meta["timing_method"] == METHOD_EVENTS
    assert meta["extra"] == {"note": "a"} and meta["status"] == "finished"
    assert meta["device"]["slug"] == "cpu-interpreter" and meta["n_records"] == 3
    assert {"commit", "dirty"} <= set(meta["git"]) and "torch" in meta["versions"]
    assert a.directory == tmp_path / "cpu-interpreter" / a.run_id


def test_unfinished_and_failed_runs_are_not_loaded(tmp_path):
    running = start_run("sweep", root=tmp_path, device=cpu_device())
    running.add({"x": 1})
    running.flush()
    with pytest.raises(RuntimeError, match="boom"):
        with start_run("sweep", root=tmp_path, device=cpu_device()) as failed:
            failed.add({"x": 2})
            raise RuntimeError("boom")
    frame, meta = load_run(failed.directory)
    assert meta["status"] == "failed" and "boom" in meta["error"] and len(frame) == 1
    assert load_runs(tmp_path).empty
    with start_run("sweep", root=tmp_path, device=cpu_device()) as ok:
        ok.add({"x": 3})
    assert load_runs(tmp_path)["x"].tolist() == [3]


def test_finish_twice_is_harmless_and_add_after_finish_is_refused(tmp_path):
    run = start_run("sweep", root=tmp_path, device=cpu_device())
    run.add({"x": 1})
    run.finish()
    run.finish()
    assert load_runs(tmp_path)["x"].tolist() == [1]
    with pytest.raises(RuntimeError, match="finished"):
        run.add({"x": 2})


def test_crash_before_replace_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        atomic_write_bytes(path, b"new content")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # temp file removed


def test_crash_during_flush_keeps_the_previous_results(tmp_path, monkeypatch):
    run = start_run("sweep", root=tmp_path, device=cpu_device())
    run.add({"x": 1})
    run.flush()
    run.add({"x": 2})
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        run.finish()
    monkeypatch.undo()
    import pandas as pd

    assert pd.read_parquet(run.directory / RESULTS_FILE)["x"].tolist() == [1]
    assert json.loads((run.directory / RUN_FILE).read_text())["status"] == "running"
    assert sorted(p.name for p in run.directory.iterdir()) == [RESULTS_FILE, RUN_FILE]


def test_env_toggles_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("QSA_SCORER", "stacked")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("UNRELATED_VAR", "no")
    monkeypatch.setenv("MY_QSA_X", "no")
    run = start_run("sweep", root=tmp_path, device=cpu_device())
    env = json.loads((run.directory / RUN_FILE).read_text())["env"]
    assert env["QSA_SCORER"] == "stacked" and env["TRITON_INTERPRET"] == "1"
    assert env["HIP_VISIBLE_DEVICES"] == "3"
    assert "UNRELATED_VAR" not in env and "MY_QSA_X" not in env
    assert env_toggles({"QSA_A": "1", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0",
                        "ROCR_VISIBLE_DEVICES": "1", "QSA_SWEEP_PARENT": "4242",
                        "QSA_ROOT": "/src"}) == {
        "CUDA_VISIBLE_DEVICES": "0", "QSA_A": "1", "ROCR_VISIBLE_DEVICES": "1"}


def test_run_id_format_and_kind_check():
    rid = new_run_id("scorer")
    assert re.fullmatch(r"\d{8}-\d{6}-scorer-[0-9a-f]{6}", rid)
    assert new_run_id("scorer") != rid
    for bad in ("", "a/b", "Scorer", "-x"):
        with pytest.raises(ValueError, match="kind"):
            new_run_id(bad)


def test_bad_records_are_refused_with_the_field_named(tmp_path):
    run = start_run("sweep", root=tmp_path, device=cpu_device())
    with pytest.raises(ValueError, match="run_id"):
        run.add({"run_id": "x"})
    with pytest.raises(TypeError, match="'cfg'"):
        run.add({"cfg": {"BLOCK": 64}})
    with pytest.raises(TypeError, match="'m'"):
        run.add({"m": [[1, 2]]})
    with pytest.raises(TypeError, match="JSON"):
        start_run("sweep", root=tmp_path, device=cpu_device(), extra={"obj": object()})


def test_the_workbench_outputs_do_not_make_a_checkout_dirty(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "k.py").write_text("x = 1\n")
    git("add", "k.py")
    git("commit", "-q", "-m", "c")
    assert git_state(tmp_path)["dirty"] is False
    for out in results.OUTPUT_PATHS:
        (tmp_path / out / "run").mkdir(parents=True)
        (tmp_path / out / "run" / "results.parquet").write_bytes(b"x")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "k.py").write_text("x = 2\n")
    assert git_state(tmp_path)["dirty"] is True


def test_git_state_outside_a_repository(tmp_path):
    state = git_state(tmp_path)
    assert state["commit"] == "unknown" and state["dirty"] is None
    assert "not in a git checkout" in state["why"]
    assert results.git_state()["dirty"] in (True, False, None)


def test_an_exported_tree_inside_another_repository_records_no_commit(tmp_path):
    """A `git archive` of the project unpacked inside some other repository: that
    repository's commit is not the tree's, so the run records `unknown` and says why."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "x.txt").write_text("x\n")
    git("add", "x.txt")
    git("commit", "-q", "-m", "c")
    tree = tmp_path / "vendor" / "qsa-workbench"
    tree.mkdir(parents=True)
    state = git_state(tree)
    assert state["commit"] == "unknown" and state["dirty"] is None
    assert f"inside the repository {tmp_path.resolve()}" in state["why"]
    assert len(git_state(tmp_path)["commit"]) == 40  # the top level itself: its own commit
