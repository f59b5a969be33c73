"""`qsa ab`: the same bench or step points measured by two revisions of the package, taking
turns on one device, and judged by `qsa compare`.

Each revision runs in a child interpreter of its own (`ab_child.py`), started once and kept
warm for the whole A/B, that imports that revision's `qsa/`: the working tree as it is, or a
commit's `qsa/` unpacked from `git archive`. The parent hands both the same point and waits
for each answer before the next call, A then B on even rounds and B then A on odd ones, so
whatever drifts on the device (clocks, temperature, the host's speed) reaches both sides alike
and only one side runs at any moment. Why children rather than both trees imported into one
process under two package names (as earlier lab scripts did, rewriting `import qsa` with a
regular expression): renaming misses imports inside functions and `importlib` strings, and
what a revision sets up when it is imported (its config tables, switches read from the
environment, Triton's per-process target state, caches) would be shared between the sides or
clobbered; a child runs its revision exactly as an installed copy would, and a revision that
crashes takes only its own side down, with its log.

The parent launches no kernel: it pools each side's rounds of a point into one record (every
sample kept, the statistics recomputed), writes the sides as two runs of kind "ab" in the
results store, each tagged with its revision, and leaves the verdict to `qsa compare`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from qsa.formats import check_index_format, check_kv_format
from qsa.measure.device import Ceilings, load_or_measure_ceilings
from qsa.measure.results import UNKNOWN_COMMIT, git_state, start_run
from qsa.measure.roofline import roofline_fractions
from qsa.measure.timing import SIZING_HOST, summarize_samples
from qsa.measure.work import Work
from qsa.presets import ModelPreset
from qsa.trace import read_trace
from qsa.workbench.compare import DEFAULT_KEYS
from qsa.workbench.ops import Point
from qsa.workbench.step import step_calls, trace_shape

CHILD = Path(__file__).with_name("ab_child.py")
CHILD_LOG = "child.log"  # in each side's run folder: what its revision printed
KIND = "ab"
# --head's default. No git ref contains a space, so it can not name a commit.
WORKING_TREE = "working tree"
MEASURE_MODULE = "qsa/workbench/ops.py"  # what a revision needs: its measure()
# What tells an A/B's points apart: the shape columns `qsa compare` matches on, and the
# overlap, sharing and environment toggles a bench grid can vary.
KEYS: tuple[str, ...] = (*DEFAULT_KEYS, "overlap_target", "sharing", "env")


class ABError(ValueError):
    """A revision, checkout or argument `qsa ab` can not use: the user's to fix."""


class SideFailed(RuntimeError):
    """A side's child interpreter died or imported the wrong package: the A/B stops."""


class PointFailed(Exception):
    """A side could not measure one point; the message is the revision's error."""


@dataclass(frozen=True)
class Revision:
    """One side: the revision as given (or WORKING_TREE), its commit, and whether uncommitted
    changes are part of it."""

    name: str
    commit: str
    dirty: bool | None = False

    @property
    def label(self) -> str:
        return f"{self.name} ({self.commit[:10]}{', uncommitted changes' if self.dirty else ''})"

    def git_record(self) -> dict[str, Any]:
        """The side's run records this as its git state; `qsa compare` labels runs by it."""
        return {"commit": self.commit, "dirty": self.dirty, "revision": self.name}


def checkout() -> Path:
    """The git checkout this package runs from: revisions are resolved in it."""
    root = Path(__file__).resolve().parents[2]
    state = git_state(root)
    if state["commit"] == UNKNOWN_COMMIT:
        raise ABError(f"qsa ab needs the package in a git checkout: {state['why']}")
    return root


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=300)


def resolve_revision(repo: Path, rev: str | None, option: str) -> Revision:
    """`rev` as a commit of the checkout `repo` that has a `measure()` to run; None is the
    working tree, uncommitted changes included (and recorded as `dirty`)."""
    if rev is None:
        state = git_state(repo)
        if state["commit"] == UNKNOWN_COMMIT:
            raise ABError(f"{option}: the working tree has no commit to record: {state['why']}")
        return Revision(WORKING_TREE, state["commit"], state["dirty"])
    res = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if res.returncode != 0:
        raise ABError(f"{option}: unknown revision {rev!r} in {repo}")
    commit = res.stdout.decode().strip()
    if _git(repo, "cat-file", "-e", f"{commit}:{MEASURE_MODULE}").returncode != 0:
        raise ABError(f"{option}: revision {rev!r} has no {MEASURE_MODULE} to measure with")
    return Revision(rev, commit)


def source_tree(repo: Path, rev: Revision, into: Path) -> Path:
    """The folder whose `qsa/` is `rev`'s: the checkout itself for the working tree, else the
    commit's `qsa/` unpacked into `into`. Nothing else of the commit is needed: the config
    tables and suites live in the package, and ceilings are read from the current folder."""
    if rev.name == WORKING_TREE:
        return repo
    res = _git(repo, "archive", "--format=tar", rev.commit, "qsa")
    if res.returncode != 0:
        raise ABError(f"git archive {rev.commit} qsa: {res.stderr.decode().strip()}")
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


# --- the points ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ABPoint:
    """One point both sides measure: `measure()` keywords; for a step's kernel call, also the
    (step, calls per step) of every step it is a call of."""

    kwargs: Mapping[str, Any]
    steps: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        k = self.kwargs
        extra = [f"overlap {k['overlap']:g}" if k.get("overlap") else "",
                 k.get("sharing", ""), k.get("selection", ""),
                 " ".join(f"{n}={v}" for n, v in k.get("env", {}).items())]
        return " ".join([f"{k['op']} b{k['batch']} c{k['context']} r{k['rows']} "
                         f"{k.get('index_format', 'bf16')}/{k.get('kv_format', 'bf16')}",
                         *filter(None, extra)])


def measure_kwargs(point: Point, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The `measure()` keywords of a point: its shape and the fields that differ from their
    defaults, so a revision whose `measure()` predates a keyword still takes the points that
    leave it at its default."""
    kw: dict[str, Any] = {"op": point.op, "preset": point.preset.name, "batch": point.batch,
                          "context": point.context, "rows": point.rows}
    for f in dataclasses.fields(point):
        if f.default is not dataclasses.MISSING and getattr(point, f.name) != f.default:
            kw[f.name] = getattr(point, f.name)
    if env:
        kw["env"] = dict(env)
    return kw


def bench_points(preset: ModelPreset, ops: Sequence[str], batches: Sequence[int],
                 contexts: Sequence[int], rows: Sequence[int], index_formats: Sequence[str],
                 kv_formats: Sequence[str], overlaps: Sequence[float],
                 sharings: Sequence[str], *, selection: str = "index",
                 env: Mapping[str, str] | None = None, trace: str | None = None,
                 trace_layer: int | None = None) -> list[ABPoint]:
    """The points of a `qsa bench` grid, every product of the lists; with a trace, its
    requests replace the batches, contexts and rows. A bad point raises ValueError here."""
    if trace is not None:
        t = read_trace(trace, preset)
        t.layer_at(trace_layer)
        batches, contexts = [int(t.context_lens.numel())], [int(t.context_lens.max())]
        rows, selection = [max(t.rows_per_request)], "trace"
    grid = itertools.product(ops, batches, contexts, rows, index_formats, kv_formats, overlaps,
                             sharings)
    return [ABPoint(measure_kwargs(Point(o, preset, b, c, r, check_index_format(fi),
                                         check_kv_format(fk), selection=selection, overlap=ov,
                                         sharing=sh, trace=trace, trace_layer=trace_layer),
                                   env))
            for o, b, c, r, fi, fk, ov, sh in grid]


def step_points(preset: ModelPreset, batch: int, context: int, mtp: int,
                pairs: Sequence[tuple[str, str]], overlaps: Sequence[float], *,
                phase: str = "decode", rows: int | None = None,
                trace: str | None = None) -> list[ABPoint]:
    """The kernel calls of `qsa step` (one decode step or prefill chunk per format pair and
    overlap) as points: a call several steps make (the draft layer's, in every pair) is
    measured once and counted in each. With a trace, its requests set the batch and context
    (and a prefill chunk's rows)."""
    p = preset.replace(mtp_draft_tokens=mtp)
    if trace is not None:
        if list(overlaps) != [0.0]:
            raise ValueError("--overlap: a trace's selections overlap as recorded")
        batch, context, trace_rows = trace_shape(trace, p)
        if phase == "prefill":
            rows = trace_rows
        elif trace_rows != mtp + 1:
            raise ValueError(f"--trace: {trace_rows} rows per request; a decode step with MTP "
                             f"{mtp} verifies {mtp + 1}")
    points: dict[str, ABPoint] = {}
    for ov in overlaps:
        for index_format, kv_format in pairs:
            step = f"{phase} {index_format}/{kv_format}, overlap {ov:g}"
            for c in step_calls(p, mtp, index_format, kv_format, phase=phase, rows=rows):
                kw = measure_kwargs(c.point(p, batch, context, ov, trace))
                key = json.dumps(kw, sort_keys=True)
                seen = points.get(key, ABPoint(kw))
                points[key] = dataclasses.replace(seen, steps=(*seen.steps,
                                                               (step, c.calls_per_step)))
    return list(points.values())


# --- the sides -----------------------------------------------------------------------------


class Side(Protocol):
    """What the alternation needs of a side: measure one point (or raise PointFailed)."""

    def measure(self, point: Mapping[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ChildSide:
    """One revision's child interpreter (`ab_child.py` on the package under `tree`), its
    stderr in `log`. It starts importing at once; the first call waits until it is ready."""

    def __init__(self, tree: Path, log: Path) -> None:
        self.tree, self.log = tree, log
        path = os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))
        with open(log, "ab") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, str(CHILD), str(tree)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env={**os.environ,
                                                                     "PYTHONPATH": path})
        self._ready = False

    def measure(self, point: Mapping[str, Any]) -> dict[str, Any]:
        if not self._ready:
            self._check_ready()
        try:
            self.proc.stdin.write(json.dumps(point) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise SideFailed(self._died()) from None
        reply = self._reply()
        if "error" in reply:
            raise PointFailed(reply["error"])
        return reply["record"]

    def close(self) -> None:
        """End the child: its input closes, so its loop ends; killed if it does not."""
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _check_ready(self) -> None:
        reply = self._reply()
        if "error" in reply:
            raise SideFailed(f"{self.tree}: its qsa does not import: {reply['error']}")
        where = Path(reply["ready"]).resolve()
        if not where.is_relative_to(self.tree.resolve()):
            raise SideFailed(f"the child for {self.tree} imported qsa from {where}")
        self._ready = True

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise SideFailed(self._died())
        return json.loads(line)

    def _died(self) -> str:
        code = self.proc.wait()
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return (f"the child measuring {self.tree} exited ({code}); its log {self.log} ends: "
                f"{lines[-1] if lines else '(empty)'}")


# --- the A/B -------------------------------------------------------------------------------


def alternate(points: Sequence[Mapping[str, Any]], sides: Sequence[Side], rounds: int,
              on_failure: Callable[[int, int, str], None]) -> list[list[list[dict[str, Any]]]]:
    """Every point measured `rounds` times by every side, taking turns: each round runs the
    points in order, each by A then B on even rounds and B then A on odd ones, so neither
    side always runs right after the other. A point a side fails is reported once,
    `on_failure(side, point, error)`, and left out for that side from then on. Returns
    records[side][point], the rounds' records (none where the side failed the point)."""
    records: list[list[list[dict[str, Any]]]] = [[[] for _ in points] for _ in sides]
    failed: set[tuple[int, int]] = set()
    for r in range(rounds):
        order = list(range(len(sides)))[::1 if r % 2 == 0 else -1]
        for i, point in enumerate(points):
            for s in order:
                if (s, i) in failed:
                    continue
                try:
                    records[s][i].append(sides[s].measure(point))
                except PointFailed as e:
                    failed.add((s, i))
                    records[s][i] = []
                    on_failure(s, i, str(e))
    return records


def pool_rounds(rounds: Sequence[Mapping[str, Any]],
                ceilings: Callable[[], Ceilings | None]) -> dict[str, Any]:
    """One record of a point from its rounds: every round's samples pooled and the statistics
    recomputed over them (`summarize_samples`), the rounds' medians kept (`round_us`: drift
    during the A/B shows there), and the roofline columns recomputed for the pooled median.
    Rounds timed differently (a graph capture that failed once) can not be pooled."""
    first = rounds[0]
    taken = sorted({f"{r['method']}/{r['cache_policy']}" for r in rounds})
    if len(taken) > 1:
        raise PointFailed(f"its rounds were timed differently ({', '.join(taken)})")
    timing = summarize_samples([x for r in rounds for x in r["samples_us"]],
                               method=first["method"], cache_policy=first["cache_policy"],
                               calls_per_sample=min(r["calls_per_sample"] for r in rounds),
                               functional_only=first["functional_only"],
                               note=first.get("note", ""),
                               sizing=first.get("sizing", SIZING_HOST))  # older records
    rec = {**first, **timing.as_record(), "us": timing.median_us, "rounds": len(rounds),
           "round_us": [r["us"] for r in rounds]}
    if first.get("pct_bandwidth") is not None and (c := ceilings()) is not None:
        rec.update(roofline_fractions(timing.median_us, Work(int(first["bytes_moved"]),
                                                             int(first["flops"])), c,
                                      matrix=first["matrix_ceiling"],
                                      bandwidth=first["bandwidth_ceiling"]))
    return rec


@dataclass(frozen=True)
class ABRuns:
    """The two sides' runs, the columns to compare them on, each side's pooled records
    (None where it failed the point), and one line per failure."""

    runs: tuple[Path, Path]
    keys: tuple[str, ...]
    records: tuple[list[dict[str, Any] | None], list[dict[str, Any] | None]]
    failures: tuple[str, ...]


def run_ab(points: Sequence[ABPoint], revisions: tuple[Revision, Revision], *, repo: Path,
           rounds: int, root: Path, device: Any, args: Sequence[str] = (),
           start: Callable[[Path, Path], Side] = ChildSide,
           say: Callable[[str], None] = print) -> ABRuns:
    """Measure `points` with both revisions in turn (`alternate`) and store each side's
    pooled records as a run of kind "ab" under `root` (its git state the revision's, its
    extra the A/B's arguments and the other side). `start(tree, log)` makes a side from the
    folder holding its `qsa/` (a child interpreter; tests pass stand-ins)."""
    failures: list[str] = []

    def failed(side: int, i: int, error: str) -> None:
        failures.append(f"{'AB'[side]} ({revisions[side].name}) {points[i].label}: {error}")
        say(failures[-1])

    with tempfile.TemporaryDirectory(prefix="qsa-ab-") as tmp, contextlib.ExitStack() as stack:
        trees = [source_tree(repo, rev, Path(tmp) / side) for side, rev in zip("ab", revisions)]
        runs = [stack.enter_context(start_run(
            KIND, root=root, device=device, git=rev.git_record(),
            extra={"ab": {"side": side, "args": list(args), "rounds": rounds,
                          "against": other.git_record()}}))
            for side, rev, other in zip("AB", revisions, revisions[::-1])]
        sides = []
        for tree, run in zip(trees, runs):
            sides.append(start(tree, run.directory / CHILD_LOG))
            stack.callback(sides[-1].close)  # closed before the runs are finished
        records = alternate([p.kwargs for p in points], sides, rounds, failed)
        ceilings = functools.cache(lambda: load_or_measure_ceilings(device))
        pooled: list[list[dict[str, Any] | None]] = [[], []]
        for i, point in enumerate(points):
            for s in (0, 1):
                try:
                    pooled[s].append(pool_rounds(records[s][i], ceilings)
                                     if records[s][i] else None)
                except PointFailed as e:
                    pooled[s].append(None)
                    failed(s, i, str(e))
            a, b = pooled[0][-1], pooled[1][-1]
            if a and b:
                say(f"{point.label}: A {a['us']:.2f} µs, B {b['us']:.2f} µs "
                    f"({len(a['samples_us'])} + {len(b['samples_us'])} samples)")
        for run, side in zip(runs, pooled):
            run.add_many(r for r in side if r is not None)
    present = [set(r) for side in pooled for r in side if r is not None]
    keys = tuple(k for k in KEYS if present and all(k in cols for cols in present))
    return ABRuns((runs[0].directory, runs[1].directory), keys, (pooled[0], pooled[1]),
                  tuple(failures))


def step_sums(points: Sequence[ABPoint],
              records: tuple[Sequence[dict[str, Any] | None], ...]) -> list[str]:
    """For each step the points are calls of: µs per step summed over its kernel calls, A and
    B, and their ratio (a kernel either side failed leaves its step out)."""
    sums: dict[str, list[float]] = {}
    for i, point in enumerate(points):
        for step, calls in point.steps:
            acc = sums.setdefault(step, [0.0, 0.0])
            for s in (0, 1):
                rec = records[s][i]
                acc[s] += rec["us"] * calls if rec is not None else math.nan
    return [f"{step}: A {a:.1f} µs, B {b:.1f} µs per step, summed over its kernel calls "
            f"(A/B {a / b:.3f}x)" for step, (a, b) in sums.items() if a == a and b == b]
