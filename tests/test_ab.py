"""`qsa ab`: two revisions of the package measure the same points in turns, each in its own
interpreter, and `qsa compare` judges the two runs. On the CPU: revisions resolved and
extracted from git, arguments parsed as bench and step parse them, the turn order, the pooling
of rounds, the child protocol (against a stand-in package), and the stored runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qsa.cli import app
from qsa.measure.device import Ceilings
from qsa.measure.results import git_state, load_run
from qsa.measure.roofline import roofline_fractions
from qsa.measure.timing import METHOD_GRAPH, SIZING_DEVICE, summarize_samples
from qsa.measure.work import Work
from qsa.presets import get_preset
from qsa.workbench import ab
from qsa.workbench.compare import compare_runs
from support import FakeDevice

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], capture_output=True, text=True, check=True).stdout.strip()


def test_a_revision_resolves_to_its_commit_and_unpacks_its_package(tmp_path):
    head = ab.resolve_revision(REPO, "HEAD", "--base")
    assert head == ab.Revision("HEAD", _git(REPO, "rev-parse", "HEAD"), False)
    tree = ab.source_tree(REPO, head, tmp_path / "a")
    ops = (tree / ab.MEASURE_MODULE).read_text()
    assert ops == _git(REPO, "show", f"HEAD:{ab.MEASURE_MODULE}") + "\n"
    assert (tree / "qsa" / "configs" / "tables").is_dir() and not (tree / "profiles").exists()
    work = ab.resolve_revision(REPO, None, "--head")  # uncommitted changes: kept, and recorded
    assert (work.name, work.dirty) == (ab.WORKING_TREE, git_state(REPO)["dirty"])
    assert ab.source_tree(REPO, work, tmp_path / "b") == REPO
    assert work.git_record() == {"commit": head.commit, "dirty": work.dirty,
                                 "revision": "working tree"}


def test_an_unknown_revision_or_one_without_the_package_is_refused_by_name(tmp_path):
    with pytest.raises(ab.ABError, match="--base: unknown revision 'no-such-branch'"):
        ab.resolve_revision(REPO, "no-such-branch", "--base")
    with pytest.raises(ab.ABError, match="unknown revision '--help'"):  # not taken for an option
        ab.resolve_revision(REPO, "--help", "--base")
    other = tmp_path / "repo"
    other.mkdir()
    _git(other, "init", "-q")
    (other / "README.md").write_text("no package here\n")
    _git(other, "add", "README.md")
    _git(other, "commit", "-q", "-m", "first")
    with pytest.raises(ab.ABError, match="'HEAD' has no qsa/workbench/ops.py"):
        ab.resolve_revision(other, "HEAD", "--head")


def test_bench_and_step_arguments_become_the_points_their_commands_measure():
    p = get_preset()
    grid = ab.bench_points(p, ["compress", "kv_store"], [1, 8], [4096], [4], ["bf16"],
                           ["bf16", "fp8"], [0.0], ["auto"], env={"QSA_X": "1"})
    assert len(grid) == 8 and grid[0].kwargs == {"op": "compress", "preset": p.name,
                                                 "batch": 1, "context": 4096, "rows": 4,
                                                 "env": {"QSA_X": "1"}}  # defaults left out
    assert {pt.kwargs.get("kv_format", "bf16") for pt in grid} == {"bf16", "fp8"}
    with pytest.raises(ValueError, match="'int4' is not one of"):
        ab.bench_points(p, ["compress"], [1], [64], [2], ["int4"], ["bf16"], [0.0], ["auto"])
    # A decode step per pair: the draft layer's calls (BF16 caches in every pair) are the same
    # points in both steps, measured once and counted in each.
    step = ab.step_points(p, 8, 32768, 3, [("bf16", "bf16"), ("fp8", "fp8")], [0.0])
    names = {s for pt in step for s, _ in pt.steps}
    assert names == {"decode bf16/bf16, overlap 0", "decode fp8/fp8, overlap 0"}
    shared = [pt for pt in step if len(pt.steps) == 2]
    assert shared and all(pt.kwargs["rows"] == 1 for pt in shared)  # the draft calls
    target = [pt for pt in step if pt.kwargs["rows"] == 4]
    assert {pt.kwargs["op"] for pt in target} == {"compress", "kv_store", "score_stacked",
                                                  "topk_expand", "sparse_gqa_decode"}
    assert all(calls == len(p.qsa_layers) for pt in target for _, calls in pt.steps)


def _record(point: dict, samples: list[float], pct: float | None = None) -> dict:
    """What measure() returns for a point, with these per-call samples (µs)."""
    t = summarize_samples(samples, method=METHOD_GRAPH, cache_policy="rotate_300MiB_x3",
                          calls_per_sample=64, sizing=SIZING_DEVICE)
    rec = {**point, "index_format": "bf16", "kv_format": "bf16", "selection": "index",
           "overlap_target": 0.0, "sharing": "auto", "env": "{}", "verified": True,
           **t.as_record(), "us": t.median_us, "bytes_moved": 10**8, "flops": 10**9,
           "pct_bandwidth": pct, "matrix_ceiling": "bf16", "bandwidth_ceiling": "copy"}
    return rec


class FakeSide:
    """A side that answers from a seeded normal distribution around `us`, logs every call,
    and fails the points of `fails`."""

    def __init__(self, name: str, us: float, log: list, fails: str = "") -> None:
        self.name, self.us, self.log, self.fails = name, us, log, fails
        self.rng = np.random.default_rng(len(log))
        self.closed = False

    def measure(self, point):
        self.log.append((self.name, point["op"]))
        if point["op"] == self.fails:
            raise ab.PointFailed("KeyError: not in this revision")
        return _record(dict(point), list(self.us + self.rng.normal(0, 0.05, 20)))

    def close(self):
        self.closed = True


def test_the_sides_take_turns_and_each_side_is_one_run_tagged_with_its_revision(tmp_path):
    """Every round runs every point with both sides, A first in even rounds and B first in odd
    ones; each side's rounds are pooled (every sample kept) into one run of kind ab whose git
    state is its revision's; a point one side fails is reported and left to the other side;
    `qsa compare` finds B faster where its samples are."""
    p = get_preset()
    points = ab.bench_points(p, ["compress", "kv_store"], [1], [4096], [4], ["bf16"], ["bf16"],
                             [0.0], ["auto"])
    revs = (ab.resolve_revision(REPO, "HEAD", "--base"),
            ab.Revision(ab.WORKING_TREE, "b" * 40, True))
    calls, sides, said = [], [], []

    def start(tree, log):
        assert (tree / ab.MEASURE_MODULE).is_file() and log.name == ab.CHILD_LOG
        assert log.parent.is_dir() and (tree == REPO) == bool(sides)  # B: the working tree
        sides.append(FakeSide("AB"[len(sides)], 10.0 if not sides else 8.0, calls,
                              fails="" if sides else "kv_store"))
        return sides[-1]

    res = ab.run_ab(points, revs, repo=REPO, rounds=3, root=tmp_path, device=FakeDevice(),
                    start=start, say=said.append, args=["bench", "--op", "compress,kv_store"])
    assert calls == [("A", "compress"), ("B", "compress"), ("A", "kv_store"), ("B", "kv_store"),
                     ("B", "compress"), ("A", "compress"), ("B", "kv_store"),  # A failed it
                     ("A", "compress"), ("B", "compress"), ("B", "kv_store")]
    assert all(s.closed for s in sides)
    assert res.failures == ("A (HEAD) kv_store b1 c4096 r4 bf16/bf16: KeyError: not in this "
                            "revision",) and res.failures[0] in said
    a, b = (load_run(r) for r in res.runs)
    assert [m["kind"] for _, m in (a, b)] == ["ab", "ab"]
    assert b[1]["git"] == revs[1].git_record()
    assert b[1]["extra"]["ab"] == {"side": "B", "args": ["bench", "--op", "compress,kv_store"],
                                   "rounds": 3, "against": a[1]["git"]}
    assert list(a[0]["op"]) == ["compress"] and list(b[0]["op"]) == ["compress", "kv_store"]
    pooled = b[0].iloc[0]
    assert pooled["n_samples"] == 60 and pooled["rounds"] == 3 and len(pooled["round_us"]) == 3
    assert pooled["us"] == pytest.approx(np.median(pooled["samples_us"]))
    cmp, _ = compare_runs(*res.runs, keys=res.keys)
    assert cmp.counts["faster"] == 1 and cmp.counts["only_b"] == 1
    assert cmp.label_b.startswith("working tree (commit bbbbbbbbbb)")


def test_rounds_pool_every_sample_and_recompute_the_roofline():
    ceilings = Ceilings(device_slug="nvidia-h200", copy_gbps=4000.0, read_gbps=5000.0,
                        bf16_tflops=800.0, fp8_tflops=1600.0, fp8_note="e4m3fn", method={},
                        date="2026-12-01", versions={})
    work = Work(10**8, 10**9)
    point = {"op": "compress", "batch": 1, "context": 64, "rows": 2}
    rounds = [_record(point, [10.0, 11.0, 12.0]), _record(point, [20.0, 21.0, 22.0])]
    for r in rounds:
        r.update(roofline_fractions(r["us"], work, ceilings))
    pooled = ab.pool_rounds(rounds, lambda: ceilings)
    assert pooled["samples_us"] == [10.0, 11.0, 12.0, 20.0, 21.0, 22.0]
    assert pooled["us"] == 16.0 and pooled["round_us"] == [11.0, 21.0]
    assert pooled["pct_bandwidth"] == roofline_fractions(16.0, work, ceilings)["pct_bandwidth"]
    rounds[1]["method"] = "device_events"  # a round whose graph capture failed
    with pytest.raises(ab.PointFailed, match="timed differently"):
        ab.pool_rounds(rounds, lambda: ceilings)


def _stand_in(root: Path, ops_py: str) -> Path:
    """A package tree whose `qsa.workbench.ops` is `ops_py`: the child protocol without torch."""
    for d in ("qsa", "qsa/workbench"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("")
    (root / ab.MEASURE_MODULE).write_text(ops_py)
    return root


def test_a_child_measures_with_its_own_package_and_reports_errors_and_death(tmp_path):
    tree = _stand_in(tmp_path / "tree", (
        "import os\n"
        "def measure(op, **kw):\n"
        "    print('stray output of the revision')\n"
        "    if op == 'boom':\n"
        "        raise ValueError('no such op here')\n"
        "    if op == 'die':\n"
        "        os._exit(3)\n"
        "    return {'op': op, 'from': __file__, **kw}\n"))
    log = tmp_path / "child.log"
    side = ab.ChildSide(tree, log)
    rec = side.measure({"op": "compress", "batch": 2})
    assert rec == {"op": "compress", "from": str(tree / ab.MEASURE_MODULE), "batch": 2}
    with pytest.raises(ab.PointFailed, match="ValueError: no such op here"):
        side.measure({"op": "boom"})
    assert side.measure({"op": "again"})["op"] == "again"  # a failed point is not fatal
    with pytest.raises(ab.SideFailed, match=r"exited \(3\); its log .*stray output"):
        side.measure({"op": "die"})
    side.close()
    assert log.read_text().count("stray output of the revision") == 4  # one per call
    broken = _stand_in(tmp_path / "broken", "def measure(:\n")
    side = ab.ChildSide(broken, tmp_path / "broken.log")
    with pytest.raises(ab.SideFailed, match="its qsa does not import: SyntaxError"):
        side.measure({"op": "compress"})
    side.close()


def test_step_sums_add_each_steps_calls_of_both_sides():
    points = [ab.ABPoint({"op": "a"}, (("s1", 2), ("s2", 2))),
              ab.ABPoint({"op": "b"}, (("s1", 3),)), ab.ABPoint({"op": "c"}, (("s2", 1),))]
    a = [{"us": 1.0}, {"us": 10.0}, {"us": 5.0}]
    b = [{"us": 1.0}, {"us": 8.0}, None]  # B failed c: its step has no sum
    assert ab.step_sums(points, (a, b)) == [
        "s1: A 32.0 µs, B 26.0 µs per step, summed over its kernel calls (A/B 1.231x)"]


@pytest.mark.parametrize("args, text", [
    (["--", "tune", "compress"], "give bench or step and its arguments"),
    ([], "got nothing"),
    (["--", "bench", "--suite", "smoke"], "--suite: an A/B measures a grid"),
    (["--", "bench", "--out", "x"], "--out: give it to ab itself"),
    (["--", "bench", "--op", "nope"], "op: 'nope' is not one of"),
    (["--", "step", "--phase", "prefill"], "a prefill chunk needs its rows"),
])
def test_ab_refuses_arguments_it_can_not_measure(args, text):
    res = runner.invoke(app, ["ab", "--base", "HEAD", *args])
    flat = " ".join(res.output.replace("│", " ").split())  # the error box wraps lines
    assert res.exit_code == 2 and text in flat, flat


def test_ab_names_an_unknown_revision():
    res = runner.invoke(app, ["ab", "--base", "HEAD", "--head", "no-such-rev", "--", "bench"])
    assert res.exit_code != 0 and "--head: unknown revision 'no-such-rev'" in str(res.exception)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_ab_stops_with_one_line_before_any_work(tmp_path):
    res = subprocess.run([sys.executable, "-m", "qsa.cli", "ab", "--base", "HEAD", "--out",
                          str(tmp_path), "--", "bench", "--op", "compress"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert lines[0] == ("error: ab: no GPU; an A/B times both revisions on one device "
                        "(interpreter times say nothing of either)") and len(lines) == 2
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_two_revisions_measure_a_point_in_their_own_interpreters(tmp_path):
    """The committed package (unpacked from git) and the working tree, each in a child under
    the interpreter: two runs, each naming its revision and holding its child's log; the
    comparison calls them incomparable (interpreter times)."""
    repo = ab.checkout()
    revs = (ab.resolve_revision(repo, "HEAD", "--base"), ab.resolve_revision(repo, None, "--head"))
    points = ab.bench_points(get_preset(), ["compress"], [1], [48], [2], ["bf16"], ["bf16"],
                             [0.0], ["auto"])
    res = ab.run_ab(points, revs, repo=repo, rounds=2, root=tmp_path, device=FakeDevice(),
                    say=lambda line: None)
    assert res.failures == ()
    for run, rev in zip(res.runs, revs):
        df, meta = load_run(run)
        assert meta["git"]["revision"] == rev.name and (run / ab.CHILD_LOG).is_file()
        assert df["verified"].all() and df["functional_only"].all()
        assert df["rounds"].tolist() == [2] and json.loads(df["env"].iloc[0]) == {}
    cmp, _ = compare_runs(*res.runs, keys=res.keys)
    assert cmp.counts["incomparable"] == 1
