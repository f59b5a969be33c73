"""A/B comparison: matching, the bootstrap verdict over stored samples, refusals, summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qsa.measure.results import start_run
from qsa.workbench import compare as cmp
from support import FakeDevice

SHAPE = {"op": "score_stacked", "preset": "qwen3.8-flash-next", "rows": 4,
         "index_format": "bf16", "kv_format": "bf16"}


def rec(batch: int, context: int, us: float, iqr: float = 2.0, **kw) -> dict:
    """A stored point whose 100 samples spread evenly over median +- iqr."""
    samples = list(us + np.linspace(-iqr, iqr, 100))
    return {**SHAPE, "batch": batch, "context": context, "us": us, "p10_us": us - iqr,
            "p90_us": us + iqr, "iqr_us": iqr, "n_samples": 100, "samples_us": samples,
            "method": "graph_replay", "cache_policy": "rotate_150MiB_x3",
            "functional_only": False, "verified": True, **kw}


def frame(*records: dict) -> pd.DataFrame:
    return pd.DataFrame(list(records))


def test_verdicts_faster_slower_same_and_unmatched() -> None:
    a = frame(rec(1, 8192, 100.0), rec(2, 8192, 100.0), rec(4, 8192, 100.0),
              rec(8, 8192, 100.0))
    b = frame(rec(1, 8192, 80.0), rec(2, 8192, 100.2), rec(4, 8192, 130.0),
              rec(16, 8192, 50.0))
    c = cmp.compare(a, b, label_a="rowwise", label_b="stacked")
    t = c.table.set_index("batch")
    assert t.loc[1, "verdict"] == "faster"
    assert t.loc[1, "speedup"] == pytest.approx(1.25)
    assert t.loc[1, "speedup_lo"] < 1.25 < t.loc[1, "speedup_hi"]
    assert t.loc[2, "verdict"] == "same"  # 0.2% apart, samples spread over +-2%
    assert t.loc[4, "verdict"] == "slower"
    assert t.loc[8, "verdict"] == "only_a" and t.loc[16, "verdict"] == "only_b"
    assert c.counts == {"faster": 1, "slower": 1, "same": 1, "incomparable": 0, "only_a": 1,
                        "only_b": 1}
    assert c.keys == ("op", "preset", "batch", "context", "rows", "index_format", "kv_format")
    want = math.exp((math.log(1.25) + math.log(100 / 100.2) + math.log(100 / 130)) / 3)
    assert c.geomean_speedup == pytest.approx(want)
    text = c.summary()
    assert "B = stacked against A = rowwise" in text
    assert "95% bootstrap interval of the ratio of medians (scipy.stats.bootstrap" in text
    assert "faster 1 · slower 1 · same within noise 1" in text
    assert "only in A 1 · only in B 1" in text


def test_the_interval_decides_not_the_spread_of_one_side() -> None:
    """10% apart: with many samples the interval excludes 1 even when one side's spread is
    wider than 10% (the old IQR rule called that noise); 2% apart over widely scattered
    samples, it does not."""
    wide = cmp.compare(frame(rec(1, 8192, 100.0, iqr=12.0)), frame(rec(1, 8192, 110.0, iqr=1.0)))
    assert wide.table["verdict"].item() == "slower"
    scattered = np.random.default_rng(1).uniform(50, 150, 20)
    noisy_a = {**rec(1, 8192, 100.0), "samples_us": list(scattered)}
    noisy_b = {**rec(1, 8192, 102.0), "samples_us": list(scattered[::-1] * 1.02)}
    noisy = cmp.compare(frame(noisy_a), frame(noisy_b))
    assert noisy.table["verdict"].item() == "same"
    lo, hi = noisy.table[["speedup_lo", "speedup_hi"]].iloc[0]
    assert lo < 1 < hi


def test_the_interval_is_reproducible() -> None:
    a, b = rec(1, 8192, 100.0)["samples_us"], rec(1, 8192, 97.0)["samples_us"]
    assert cmp.speedup_interval(a, b) == cmp.speedup_interval(a, b)


def test_records_without_enough_samples_are_incomparable() -> None:
    old = {k: v for k, v in rec(1, 8192, 100.0).items() if k != "samples_us"}
    few = {**rec(1, 8192, 90.0), "samples_us": [90.0, 91.0]}
    for a, b, side, n in ((old, rec(1, 8192, 50.0), "A", 0), (rec(1, 8192, 50.0), few, "B", 2)):
        v, lo, hi, reason = cmp.verdict(a, b)
        assert v == "incomparable" and math.isnan(lo) and math.isnan(hi)
        assert reason == f"{side} keeps {n} per-sample times; the test needs {cmp.MIN_SAMPLES}"


@pytest.mark.parametrize("change, reason", [
    ({"method": "device_events"}, "taken differently"),
    ({"functional_only": True}, "functional"),
    ({"verified": False}, "failed verification"),
])
def test_pairs_that_can_not_be_ranked_are_incomparable(change: dict, reason: str) -> None:
    c = cmp.compare(frame(rec(1, 8192, 100.0)), frame(rec(1, 8192, 50.0, **change)))
    assert c.table["verdict"].item() == "incomparable"
    assert reason in c.table["reason"].item()
    assert math.isnan(c.geomean_speedup)
    assert "incomparable because" in c.summary()


def test_short_graph_samples_sized_by_host_launch_time_are_incomparable() -> None:
    # Records from before device-sized samples carry no `sizing`: 4 calls of a 5 us kernel per
    # graph is a 20 us sample, whose per-call time includes a quarter of the replay's own cost.
    old = rec(1, 8192, 5.0, iqr=0.1, calls_per_sample=4)
    new = rec(1, 8192, 3.4, iqr=0.1, calls_per_sample=300, sizing="device_time")
    for a, b, side in ((old, new, "A"), (new, old, "B"), (old, old, "A")):
        v, *_, reason = cmp.verdict(a, b)
        assert v == "incomparable" and reason.startswith(f"{side} is a graph replay sized by "
                                                         "host launch time: 4 calls")
    # Long host-sized samples (a whole step per graph), device-sized ones, events: compared.
    step = rec(1, 8192, 2400.0, iqr=10.0, calls_per_sample=1)
    faster_step = rec(1, 8192, 2300.0, iqr=10.0, calls_per_sample=1, sizing="device_time")
    assert cmp.verdict(step, faster_step)[0] == "faster"
    assert cmp.verdict(new, rec(1, 8192, 3.0, iqr=0.1, calls_per_sample=300,
                                sizing="device_time"))[0] == "faster"
    events = {**old, "method": "device_events"}
    assert cmp.verdict(events, {**rec(1, 8192, 4.0, iqr=0.1, calls_per_sample=4),
                                "method": "device_events"})[0] == "faster"


def test_duplicate_points_and_missing_keys_are_refused() -> None:
    a = frame(rec(1, 8192, 100.0), rec(1, 8192, 90.0))
    with pytest.raises(ValueError, match="2 rows sharing keys"):
        cmp.compare(a, frame(rec(1, 8192, 100.0)))
    with pytest.raises(KeyError, match="missing"):
        cmp.compare(frame(rec(1, 8192, 1.0)), frame(rec(1, 8192, 1.0)), keys=["batch", "nope"])


def test_latest_per_point_keeps_the_newest_run_of_each_point() -> None:
    old = [{**rec(1, 8192, 100.0), "run_id": "20250101-000000-x-aaaaaa", "split": s}
           for s in (1, 2)]
    new = [{**rec(1, 8192, 90.0), "run_id": "20250102-000000-x-bbbbbb", "split": s}
           for s in (1, 2)]
    other = [{**rec(2, 8192, 70.0), "run_id": "20250101-000000-x-aaaaaa", "split": 1}]
    out = cmp.latest_per_point(frame(*old, *new, *other))
    assert sorted(zip(out["batch"], out["us"], out["split"])) == [
        (1, 90.0, 1), (1, 90.0, 2), (2, 70.0, 1)]


def test_compare_runs_names_the_env_toggle_that_differs(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = []
    for flag, us in (("0", 100.0), ("1", 60.0)):
        monkeypatch.setenv("QSA_STACKED_DECODE_SCORER", flag)
        with start_run("decode-scoring", root=tmp_path, device=FakeDevice()) as run:
            run.add_many([rec(1, 8192, us), rec(8, 8192, us * 2)])
        dirs.append(run.directory)
    c, diff = cmp.compare_runs(*dirs)
    assert diff["env"] == {"QSA_STACKED_DECODE_SCORER": ("0", "1")}
    assert c.device["slug"] == "nvidia-h200"
    assert c.label_a == "QSA_STACKED_DECODE_SCORER=0"
    assert c.label_b == "QSA_STACKED_DECODE_SCORER=1"
    assert c.counts["faster"] == 2
    assert c.geomean_speedup == pytest.approx(100 / 60)


@pytest.mark.slow
def test_sweep_folders_compare_point_by_point(tmp_path):
    """`qsa compare` on two sweep folders: every passed point of each, matched on its shape."""
    from qsa.workbench import sweep as sw
    from test_sweep import write_spec

    folders = []
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        spec = write_spec(tmp_path / side, grid={"value": [1, 2]})
        summary = sw.run_sweep(spec, tmp_path / side / "out", jobs=1, progress=False)
        assert summary.ok
        folders.append(next((tmp_path / side / "out").glob("*/sweeps/fixture")))
    c, _ = cmp.compare_runs(*folders)
    assert sorted(c.table["batch"]) == [1, 2] and "only_a" not in set(c.table["verdict"])
    with pytest.raises(ValueError, match="neither a run"):
        cmp.compare_runs(tmp_path, folders[1])


def test_internal_variables_are_not_what_differs() -> None:
    """Older runs recorded the sweep runner's parent pid and the set-up's paths: not toggles."""
    meta = {"device": {"slug": "d"}, "git": {}, "versions": {}}
    a = {**meta, "env": {"QSA_SWEEP_PARENT": "4242", "QSA_ROOT": "/a", "QSA_X": "0"}}
    b = {**meta, "env": {"QSA_SWEEP_PARENT": "5151", "QSA_ROOT": "/b", "QSA_X": "1"}}
    assert cmp.run_differences(a, b) == {"env": {"QSA_X": ("0", "1")}}


def test_outputs_go_to_a_new_folder_never_into_an_input(tmp_path: Path) -> None:
    c = cmp.compare(frame(rec(1, 8192, 100.0)), frame(rec(1, 8192, 80.0)),
                    device={"slug": "nvidia-h200", "name": "NVIDIA H200"})
    a, b = tmp_path / "store" / "run-a", tmp_path / "store" / "run-b"
    folder = cmp.output_folder(None, tmp_path / "store", c, (a, b))
    assert folder.parent == tmp_path / "store" / "nvidia-h200" / "compare"
    assert not folder.exists()
    for bad in (b, b / "figures"):
        with pytest.raises(ValueError, match="inside input B"):
            cmp.output_folder(bad, tmp_path, c, (a, b))
    table = cmp.write_comparison(c, {}, folder, a, b)
    index = json.loads((folder / "compare.json").read_text())
    assert table == folder / "compare.csv" and index["a"] == str(a)
    assert index["test"] == cmp.TEST and index["counts"]["faster"] == 1
