"""One timing method for every benchmark.

Why one method: numbers taken with different timers or cache states differ by up to 2x on
decode-size kernels (cold vs warm L2, launch overhead; triton-lang/triton PR #10149), so every number carries the method and cache policy it
was taken with, and comparisons across methods are refused.

Cold cache is made by *rotating input sets*, not by flushing: the caller builds `n_sets` copies
of the inputs whose total exceeds the last-level cache a few times over, and `fn_for_set(i)` runs
the kernel on copy `i`. A 256 MiB flush does not empty MI355X's 256 MB Infinity Cache, rotation
does, and rotation also works inside a captured graph (no flush kernel in the stream).

Timers, best first:
* graph replay: the calls of one sample are captured into a CUDA/HIP graph on a side stream after
  warm-up and replayed with device events around each replay; per-call time = replay time / calls.
  This removes host launch gaps, which dominate 1-50 us kernels. A replay also has a fixed cost
  of its own (the graph's launch, several us), which the calls of a sample share, so a sample
  is sized by *device* time: a probe graph is replayed first and the sample gets enough calls
  for `sample_target_us` of device work. Sized by the host's launch time instead (a Python
  wrapper takes hundreds of us per call), a 4 us kernel got 3-4 calls per graph and read 1.5-2
  us slow, by an amount that moved with the host between processes
  (profiles/nvidia-h200/timing-sizing/NOTES.md).
* device events: an event pair around a batch of plain launches. Used when asked for, and always
  when capture raises (HIP capture is fragile, so the number of captured calls is also capped).
* host wall clock: only without a GPU. The numbers are marked `functional_only`: interpreter
  times say nothing about the kernel.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

MiB = 1 << 20

METHOD_GRAPH = "graph_replay"
METHOD_EVENTS = "device_events"
METHOD_HOST = "host_wallclock_functional"

# Most calls captured into one graph. TritonBench's graph timer segfaults on MI350 when it
# captures many calls (tritonbench #1034/#1036), so HIP gets a much lower cap than CUDA.
MAX_GRAPH_CALLS_CUDA = 1000
MAX_GRAPH_CALLS_HIP = 100
# Without a GPU the times are meaningless, so the host path spends as little time as it can.
HOST_MAX_SAMPLES = 5
# How the calls of a sample were counted (the Timing's `sizing`): from a probe graph's device
# time, from a pass of plain launches (the host's time), or given by the caller. Records
# without the field are older graph replays, sized from the host's launch time.
SIZING_DEVICE = "device_time"
SIZING_HOST = "host_launch"
SIZING_CALLER = "caller"


@dataclass(frozen=True)
class Timing:
    """Per-call statistics of one timed callable, in microseconds, with how they were taken."""

    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    iqr_us: float
    n_samples: int
    samples_us: tuple[float, ...]
    method: str
    cache_policy: str
    calls_per_sample: int
    functional_only: bool = False
    note: str = ""
    sizing: str = SIZING_CALLER

    @property
    def rel_iqr(self) -> float:
        """Interquartile range relative to the median: the spread the noise rule uses."""
        if self.median_us > 0:
            return self.iqr_us / self.median_us
        return 0.0 if self.iqr_us == 0 else math.inf

    def as_record(self) -> dict[str, Any]:
        """Flat dict for one DataFrame row; the raw samples stay as a list."""
        rec = dataclasses.asdict(self)
        rec["samples_us"] = list(self.samples_us)
        return rec


def summarize_samples(samples_us: Sequence[float], *, method: str, cache_policy: str,
                      calls_per_sample: int, functional_only: bool = False,
                      note: str = "", sizing: str = SIZING_CALLER) -> Timing:
    """Statistics of per-call samples (us). Pure, so it is tested without a device.

    All samples are kept and none is dropped: the median and p10/p90 are already robust, and
    the raw list lets a reader apply another rule later.
    """
    x = np.asarray(samples_us, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"need a non-empty 1-D list of samples, got shape {x.shape}")
    if not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError(f"samples must be finite and >= 0 us, got {x.tolist()}")
    if calls_per_sample < 1:
        raise ValueError(f"calls_per_sample must be >= 1, got {calls_per_sample}")
    p10, q25, p50, q75, p90 = np.percentile(x, [10, 25, 50, 75, 90])
    return Timing(median_us=float(p50), p10_us=float(p10), p90_us=float(p90),
                  min_us=float(x.min()), iqr_us=float(q75 - q25), n_samples=int(x.size),
                  samples_us=tuple(float(v) for v in x), method=method,
                  cache_policy=cache_policy, calls_per_sample=calls_per_sample,
                  functional_only=functional_only, note=note, sizing=sizing)


# --- noise -------------------------------------------------------------------------------------
#
# Rule: time the same thing twice in one run. Two timings are the same within noise when the
# relative difference of their medians, |a - b| / min(a, b), is at most the larger of their two
# relative IQRs. A difference smaller than the run-to-run spread can not be told from noise.


def noise_floor(a: Timing, b: Timing) -> float:
    """Relative difference below which two timings are called noise: max of the relative IQRs."""
    return max(a.rel_iqr, b.rel_iqr)


def relative_difference(a: Timing, b: Timing) -> float:
    """|median_a - median_b| / min(median_a, median_b); refuses mixed methods or cache policies."""
    if (a.method, a.cache_policy) != (b.method, b.cache_policy):
        raise ValueError("can not compare timings taken differently: "
                         f"{a.method}/{a.cache_policy} vs {b.method}/{b.cache_policy}")
    lo = min(a.median_us, b.median_us)
    diff = abs(a.median_us - b.median_us)
    if lo > 0:
        return diff / lo
    return 0.0 if diff == 0 else math.inf


def same_within_noise(a: Timing, b: Timing) -> bool:
    """True when the medians differ by no more than the noise floor (rule above)."""
    return relative_difference(a, b) <= noise_floor(a, b)


@dataclass(frozen=True)
class TimedTwice:
    """The same callable timed twice in one run, so a benchmark can report its own noise."""

    first: Timing
    second: Timing

    @property
    def noise_floor(self) -> float:
        return noise_floor(self.first, self.second)

    @property
    def rel_diff(self) -> float:
        return relative_difference(self.first, self.second)

    @property
    def same_within_noise(self) -> bool:
        return same_within_noise(self.first, self.second)

    def as_record(self) -> dict[str, Any]:
        """The first timing's record plus the repeat's median and the noise verdict."""
        return {**self.first.as_record(), "repeat_median_us": self.second.median_us,
                "noise_floor_rel": self.noise_floor, "repeat_rel_diff": self.rel_diff,
                "repeat_same_within_noise": self.same_within_noise}


# --- cold cache --------------------------------------------------------------------------------


def sets_for_cold_cache(bytes_per_set: int, llc_bytes: int, factor: float = 3) -> int:
    """Smallest number of input copies whose total exceeds `factor` x the last-level cache."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    if llc_bytes < 0:
        raise ValueError(f"llc_bytes must be >= 0, got {llc_bytes}")
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    return math.floor(factor * llc_bytes / bytes_per_set) + 1


def cache_policy_name(n_sets: int, bytes_per_set: int | None) -> str:
    """"warm" when the inputs are not rotated, else "rotate_<total MiB>MiB_x<n_sets>"."""
    if bytes_per_set is None:
        if n_sets != 1:
            raise ValueError(f"rotating {n_sets} input sets needs bytes_per_set, so the cache "
                             "policy can record how much memory the rotation covers")
        return "warm"
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    return f"rotate_{round(n_sets * bytes_per_set / MiB)}MiB_x{n_sets}"


def rotation_schedule(n_sets: int, calls_per_sample: int) -> tuple[tuple[int, ...], ...]:
    """Set indices of the calls of each sample; samples cycle through the returned chunks.

    With at least `n_sets` calls per sample there is one chunk of whole passes over all sets.
    With fewer, the sets are split into near-equal contiguous chunks, so one round of samples
    still touches every set once and no set is reused before all others were.
    """
    if n_sets < 1 or calls_per_sample < 1:
        raise ValueError(f"n_sets and calls_per_sample must be >= 1, got {n_sets}, "
                         f"{calls_per_sample}")
    if calls_per_sample >= n_sets:
        passes = calls_per_sample // n_sets
        return (tuple(range(n_sets)) * passes,)
    n_chunks = math.ceil(n_sets / calls_per_sample)
    bounds = [round(k * n_sets / n_chunks) for k in range(n_chunks + 1)]
    return tuple(tuple(range(bounds[k], bounds[k + 1])) for k in range(n_chunks))


# --- timers ------------------------------------------------------------------------------------


def time_fn(fn_for_set: Callable[[int], None], n_sets: int = 1, *,
            method: Literal["auto", "graph", "events"] = "auto",
            bytes_per_set: int | None = None, warmup: int = 2, samples: int = 100,
            calls_per_sample: int | None = None, sample_target_us: float = 1000.0,
            max_graph_calls: int | None = None) -> Timing:
    """Time `fn_for_set(i)` over a rotation of `n_sets` input copies; per-call statistics in us.

    warmup: passes over all sets before timing (compilation and autotuning happen there).
    calls_per_sample: calls between one pair of events; by default enough for about
    `sample_target_us` of device time per sample: estimated from one extra warm pass of plain
    launches for device events, from a probe graph's replay for graph replay (capped at
    `max_graph_calls`).
    method: "auto" and "graph" try graph replay and fall back to device events if capture
    raises (the Timing's `note` says why); "events" never captures.
    Without a GPU the function still runs, timed by the host clock, and is marked functional.
    """
    if method not in ("auto", "graph", "events"):
        raise ValueError(f"method must be 'auto', 'graph' or 'events', got {method!r}")
    if n_sets < 1 or samples < 1 or warmup < 0:
        raise ValueError(f"need n_sets >= 1, samples >= 1, warmup >= 0; got {n_sets}, "
                         f"{samples}, {warmup}")
    if calls_per_sample is not None and calls_per_sample < 1:
        raise ValueError(f"calls_per_sample must be >= 1, got {calls_per_sample}")
    policy = cache_policy_name(n_sets, bytes_per_set)

    if not torch.cuda.is_available():
        return _time_on_host(fn_for_set, n_sets, policy, min(warmup, 1),
                             min(samples, HOST_MAX_SAMPLES), calls_per_sample or 1)

    for _ in range(warmup):
        for i in range(n_sets):
            fn_for_set(i)
    sized_by_host = calls_per_sample is None
    if calls_per_sample is None:
        per_call = _events_pass_us(fn_for_set, n_sets)
        calls_per_sample = calls_for_target(per_call, sample_target_us)

    note = ""
    if method != "events":
        cap = max_graph_calls or (MAX_GRAPH_CALLS_HIP if torch.version.hip
                                  else MAX_GRAPH_CALLS_CUDA)
        chunks = rotation_schedule(n_sets, min(calls_per_sample, cap))
        try:
            if sized_by_host:  # the host's launch time says nothing of the device's
                probe = _graph_probe_us(fn_for_set, chunks[0])
                chunks = rotation_schedule(n_sets, min(calls_for_target(probe, sample_target_us),
                                                       cap))
            raw = _graph_samples(fn_for_set, chunks, samples)
            return summarize_samples(raw, method=METHOD_GRAPH, cache_policy=policy,
                                     calls_per_sample=max(map(len, chunks)),
                                     sizing=SIZING_DEVICE if sized_by_host else SIZING_CALLER)
        except Exception as exc:  # capture support varies by op, driver and vendor
            torch.cuda.synchronize()
            note = f"graph capture failed ({type(exc).__name__}: {exc}); used device events"
    chunks = rotation_schedule(n_sets, calls_per_sample)
    raw = _event_samples(fn_for_set, chunks, samples)
    return summarize_samples(raw, method=METHOD_EVENTS, cache_policy=policy,
                             calls_per_sample=max(map(len, chunks)), note=note,
                             sizing=SIZING_HOST if sized_by_host else SIZING_CALLER)


def time_twice(fn_for_set: Callable[[int], None], n_sets: int = 1,
               **kwargs: Any) -> TimedTwice:
    """`time_fn` twice with the same settings; the repeat reuses the first's calls per sample."""
    first = time_fn(fn_for_set, n_sets, **kwargs)
    kwargs.setdefault("calls_per_sample", first.calls_per_sample)
    return TimedTwice(first, time_fn(fn_for_set, n_sets, **kwargs))


def _time_on_host(fn_for_set: Callable[[int], None], n_sets: int, policy: str, warmup: int,
                  samples: int, calls_per_sample: int) -> Timing:
    for _ in range(warmup):
        fn_for_set(0)
    chunks = rotation_schedule(n_sets, calls_per_sample)
    raw = []
    for s in range(samples):
        chunk = chunks[s % len(chunks)]
        t0 = time.perf_counter()
        for i in chunk:
            fn_for_set(i)
        raw.append((time.perf_counter() - t0) * 1e6 / len(chunk))
    return summarize_samples(raw, method=METHOD_HOST, cache_policy=policy,
                             calls_per_sample=max(map(len, chunks)), functional_only=True,
                             note="no GPU: host wall clock, functional run only")


def calls_for_target(per_call_us: float, sample_target_us: float) -> int:
    """Calls per sample so that one sample takes about `sample_target_us` (at least one)."""
    return max(1, math.ceil(sample_target_us / max(per_call_us, 1e-3)))


def _events_pass_us(fn_for_set: Callable[[int], None], n_sets: int) -> float:
    """Per-call time of one pass over all sets, to size the samples."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(n_sets):
        fn_for_set(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n_sets


def _event_samples(fn_for_set: Callable[[int], None], chunks: tuple[tuple[int, ...], ...],
                   samples: int) -> list[float]:
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(samples)]
    for s, (start, end) in enumerate(pairs):
        start.record()
        for i in chunks[s % len(chunks)]:
            fn_for_set(i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 / len(chunks[s % len(chunks)])
            for s, (start, end) in enumerate(pairs)]


def _graph_probe_us(fn_for_set: Callable[[int], None], chunk: tuple[int, ...],
                    replays: int = 3) -> float:
    """Device time per call of `chunk` captured in one graph: its fastest replay divided by its
    calls (the replay's own cost included, so the estimate errs towards fewer calls)."""
    graphs = _capture_graphs(fn_for_set, (chunk,))
    best = min(_replay_samples(graphs, (chunk,), replays))
    del graphs
    torch.cuda.synchronize()
    return best


def _capture_graphs(fn_for_set: Callable[[int], None], chunks: tuple[tuple[int, ...], ...]
                    ) -> list[Any]:
    """One graph per chunk, captured on a side stream after a warm-up there, each replayed
    once before it is timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch requires a side-stream warm-up before capture
        for chunk in chunks:
            for i in chunk:
                fn_for_set(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for chunk in chunks:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side):
            for i in chunk:
                fn_for_set(i)
        graphs.append(graph)
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    return graphs


def _replay_samples(graphs: list[Any], chunks: tuple[tuple[int, ...], ...],
                    samples: int) -> list[float]:
    """Per-call us of `samples` replays, cycling through the graphs."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(samples)]
    for s, (start, end) in enumerate(pairs):
        start.record()
        graphs[s % len(graphs)].replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 / len(chunks[s % len(chunks)])
            for s, (start, end) in enumerate(pairs)]


def _graph_samples(fn_for_set: Callable[[int], None], chunks: tuple[tuple[int, ...], ...],
                   samples: int) -> list[float]:
    return _replay_samples(_capture_graphs(fn_for_set, chunks), chunks, samples)
