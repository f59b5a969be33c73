"""Timing: statistics, noise rule, cold-cache rotation, and the no-GPU fallback."""

import contextlib
import math

import pytest
import torch
import triton.testing
from hypothesis import given
from hypothesis import strategies as st

from qsa.measure import timing
from qsa.measure.timing import (METHOD_EVENTS, METHOD_GRAPH, METHOD_HOST, MiB, Timing,
                                cache_policy_name, noise_floor, relative_difference,
                                rotation_schedule, same_within_noise, sets_for_cold_cache,
                                summarize_samples, time_fn, time_twice)


def _timing(median: float, iqr: float, method: str = METHOD_GRAPH,
            policy: str = "warm") -> Timing:
    return Timing(median_us=median, p10_us=median, p90_us=median, min_us=median, iqr_us=iqr,
                  n_samples=1, samples_us=(median,), method=method, cache_policy=policy,
                  calls_per_sample=1)


def test_summary_statistics_of_known_samples():
    t = summarize_samples([10.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
                          method=METHOD_EVENTS, cache_policy="warm", calls_per_sample=4)
    assert t.median_us == pytest.approx(5.5)
    assert t.p10_us == pytest.approx(1.9)
    assert t.p90_us == pytest.approx(9.1)
    assert t.min_us == 1.0
    assert t.iqr_us == pytest.approx(7.75 - 3.25)
    assert t.rel_iqr == pytest.approx(4.5 / 5.5)
    assert t.n_samples == 10
    assert t.samples_us[0] == 10.0  # raw samples kept in order
    rec = t.as_record()
    assert rec["samples_us"] == list(t.samples_us) and isinstance(rec["samples_us"], list)
    assert rec["method"] == METHOD_EVENTS and rec["calls_per_sample"] == 4
    assert not any(isinstance(v, (dict, tuple)) for v in rec.values())


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, -2.0], [[1.0, 2.0]]])
def test_summary_rejects_bad_samples(bad):
    with pytest.raises(ValueError):
        summarize_samples(bad, method=METHOD_EVENTS, cache_policy="warm", calls_per_sample=1)


def test_noise_verdicts():
    a = _timing(10.0, 1.0)  # relative IQR 0.10
    assert noise_floor(a, _timing(20.0, 1.0)) == pytest.approx(0.10)
    assert same_within_noise(a, _timing(10.5, 0.5))  # 5% apart, floor 10%
    assert not same_within_noise(a, _timing(12.0, 0.6))  # 20% apart, floor 10%
    assert same_within_noise(a, _timing(11.0, 2.2))  # 10% apart, floor 20%
    assert relative_difference(a, _timing(12.0, 0.6)) == pytest.approx(0.2)
    assert not same_within_noise(_timing(10.0, 0.0), _timing(10.1, 0.0))


def test_noise_refuses_mixed_methods_and_policies():
    with pytest.raises(ValueError, match="differently"):
        same_within_noise(_timing(10, 1), _timing(10, 1, method=METHOD_EVENTS))
    with pytest.raises(ValueError, match="differently"):
        same_within_noise(_timing(10, 1), _timing(10, 1, policy="rotate_200MiB_x4"))


def test_zero_medians_do_not_divide_by_zero():
    assert same_within_noise(_timing(0.0, 0.0), _timing(0.0, 0.0))
    assert relative_difference(_timing(0.0, 0.0), _timing(1.0, 0.0)) == math.inf


def test_cold_cache_set_counts():
    assert sets_for_cold_cache(8 * MiB, 50 * MiB) == 19  # H200: 152 MiB > 150 MiB
    assert sets_for_cold_cache(8 * MiB, 256 * MiB) == 97  # 96 x 8 = 768 only equals 3 x 256
    assert sets_for_cold_cache(1 << 40, 50 * MiB) == 1
    assert sets_for_cold_cache(10, 100, factor=2) == 21
    for bad in [(0, 1), (1, -1)]:
        with pytest.raises(ValueError):
            sets_for_cold_cache(*bad)


@given(st.integers(1, 1 << 30), st.integers(0, 1 << 30), st.sampled_from([1, 2, 3, 2.5]))
def test_cold_cache_sets_are_the_fewest_that_exceed(bytes_per_set, llc, factor):
    n = sets_for_cold_cache(bytes_per_set, llc, factor)
    assert n * bytes_per_set > factor * llc >= (n - 1) * bytes_per_set


def test_cache_policy_names():
    assert cache_policy_name(1, None) == "warm"
    assert cache_policy_name(97, 8 * MiB) == "rotate_776MiB_x97"
    with pytest.raises(ValueError, match="bytes_per_set"):
        cache_policy_name(4, None)


@given(st.integers(1, 500), st.integers(1, 2000))
def test_rotation_schedule_touches_every_set_evenly(n_sets, cps):
    chunks = rotation_schedule(n_sets, cps)
    if cps >= n_sets:
        assert len(chunks) == 1
        assert len(chunks[0]) == cps // n_sets * n_sets  # as many whole passes as fit
        assert chunks[0][:n_sets] == tuple(range(n_sets))
    else:
        assert sum(chunks, ()) == tuple(range(n_sets))
        sizes = [len(c) for c in chunks]
        assert max(sizes) <= cps and max(sizes) - min(sizes) <= 1


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def forbidden(*args, **kwargs):
        raise AssertionError("do_bench must never run on CPU")

    monkeypatch.setattr(triton.testing, "do_bench", forbidden)


def test_cpu_fallback_is_functional_only(monkeypatch):
    _no_gpu(monkeypatch)
    calls = []
    t = time_fn(calls.append, 3, bytes_per_set=MiB, samples=50, calls_per_sample=2)
    assert t.functional_only and t.method == METHOD_HOST
    assert t.n_samples == timing.HOST_MAX_SAMPLES
    assert t.cache_policy == "rotate_3MiB_x3"
    assert set(calls) == {0, 1, 2}
    assert t.as_record()["functional_only"] is True
    assert all(s >= 0 for s in t.samples_us)


def test_time_twice_on_cpu_reports_noise(monkeypatch):
    _no_gpu(monkeypatch)
    twice = time_twice(lambda i: None, samples=3)
    assert twice.first.functional_only and twice.second.functional_only
    rec = twice.as_record()
    assert rec["repeat_median_us"] == twice.second.median_us
    assert rec["repeat_same_within_noise"] == same_within_noise(twice.first, twice.second)
    assert rec["noise_floor_rel"] == noise_floor(twice.first, twice.second)


def test_time_fn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        time_fn(lambda i: None, method="do_bench")
    with pytest.raises(ValueError, match="bytes_per_set"):
        time_fn(lambda i: None, 4)
    with pytest.raises(ValueError):
        time_fn(lambda i: None, samples=0)


class _FakeCuda:
    """Stands in for torch.cuda so the device-timer control flow runs on CPU: events read the
    host clock, captures record which sets were called, and capture can be made to fail."""

    def __init__(self, monkeypatch, *, capture_error: Exception | None = None,
                 hip: str | None = None, host_us: float = 300.0, device_us: float = 5.0,
                 replay_us: float = 8.0):
        self.capture_error = capture_error
        self.capturing = None
        self.calls: list[tuple[int, bool]] = []
        self.graphs: list[_FakeCuda.Graph] = []
        # A simulated clock (us): an eager call costs its host launch time, a replay its own
        # launch plus the device time of its calls; events read this clock.
        self.now_us = 0.0
        self.host_us, self.device_us, self.replay_us = host_us, device_us, replay_us
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                self.t = fake.now_us * 1e-6

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        class Graph:
            def __init__(self):
                self.sets: list[int] = []
                self.replays = 0
                fake.graphs.append(self)

            def replay(self):
                self.replays += 1
                fake.now_us += fake.replay_us + fake.device_us * len(self.sets)

        class Stream:
            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            self.capturing = g
            try:
                yield
            finally:
                self.capturing = None
            if self.capture_error is not None:
                raise self.capture_error

        self.Graph = Graph
        for name, value in {"is_available": lambda: True, "Event": Event, "CUDAGraph": Graph,
                            "graph": graph, "graph_pool_handle": lambda: object(),
                            "Stream": Stream, "stream": lambda s: contextlib.nullcontext(),
                            "current_stream": Stream, "synchronize": lambda: None}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.version, "hip", hip)

    def fn(self, i: int) -> None:
        self.calls.append((i, self.capturing is not None))
        if self.capturing is not None:
            self.capturing.sets.append(i)
        else:
            self.now_us += self.host_us


def test_device_timer_uses_graph_replay_over_all_sets(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    t = time_fn(cuda.fn, 10, bytes_per_set=MiB, samples=7, calls_per_sample=4)
    assert t.method == METHOD_GRAPH and not t.functional_only and t.note == ""
    assert t.n_samples == 7 and t.calls_per_sample == 4
    assert [g.sets for g in cuda.graphs] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert [g.replays for g in cuda.graphs] == [4, 3, 3]  # one warm replay each, then 7 samples
    assert {i for i, _ in cuda.calls} == set(range(10))


def test_graph_samples_are_sized_by_device_time_not_host_launches(monkeypatch):
    # 300 us of host launch per call would give 4 calls per 1000 us sample, and each replay's
    # own 8 us would then add 2 us to a 5 us call; sized by a probe replay, a sample holds
    # ceil(1000 / ((8 + 5 * 4) / 4)) = 143 calls and the replay adds 0.06 us per call.
    cuda = _FakeCuda(monkeypatch)
    t = time_fn(cuda.fn, 1, samples=5)
    assert t.method == METHOD_GRAPH and t.calls_per_sample == 143
    probe, sampled = cuda.graphs
    assert len(probe.sets) == 4 and len(sampled.sets) == 143
    assert t.median_us == pytest.approx(5.0 + 8.0 / 143)
    assert t.sizing == timing.SIZING_DEVICE and t.as_record()["sizing"] == "device_time"
    # An explicit count is kept as given, and the repeat of `time_twice` reuses the first's.
    given = time_fn(cuda.fn, 1, samples=5, calls_per_sample=4)
    assert given.median_us == pytest.approx(7.0) and given.sizing == timing.SIZING_CALLER
    events = time_fn(cuda.fn, 1, samples=5, method="events")
    assert events.sizing == timing.SIZING_HOST and events.calls_per_sample == 4
    twice = time_twice(cuda.fn, 1, samples=5)
    assert twice.second.calls_per_sample == twice.first.calls_per_sample == 143


def test_graph_sizing_keeps_the_cap_and_the_rotation(monkeypatch):
    cuda = _FakeCuda(monkeypatch, device_us=0.01)
    t = time_fn(cuda.fn, 3, bytes_per_set=MiB, samples=4, max_graph_calls=50)
    assert t.calls_per_sample == 48  # whole passes over the 3 sets, at most 50 calls
    assert cuda.graphs[-1].sets == [0, 1, 2] * 16


def test_device_timer_falls_back_to_events_when_capture_raises(monkeypatch):
    cuda = _FakeCuda(monkeypatch, capture_error=RuntimeError("capture not permitted"))
    t = time_fn(cuda.fn, 3, bytes_per_set=MiB, samples=5, calls_per_sample=3)
    assert t.method == METHOD_EVENTS and t.n_samples == 5
    assert "graph capture failed" in t.note and "capture not permitted" in t.note
    assert all(g.replays == 0 for g in cuda.graphs)
    eager = [i for i, capturing in cuda.calls if not capturing]
    assert eager[-15:] == [0, 1, 2] * 5  # the event samples rotate through every set


def test_events_method_never_captures(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    t = time_fn(cuda.fn, 2, bytes_per_set=MiB, samples=4, method="events", warmup=0)
    assert t.method == METHOD_EVENTS and not cuda.graphs and t.calls_per_sample >= 2


def test_hip_caps_the_calls_captured_in_one_graph(monkeypatch):
    cuda = _FakeCuda(monkeypatch, hip="7.0.1")
    t = time_fn(cuda.fn, samples=3, calls_per_sample=5000)
    assert t.method == METHOD_GRAPH
    assert [len(g.sets) for g in cuda.graphs] == [timing.MAX_GRAPH_CALLS_HIP]
    assert t.calls_per_sample == timing.MAX_GRAPH_CALLS_HIP


@pytest.mark.gpu
def test_graph_replay_on_a_tiny_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)

    n = 1 << 16
    xs = [torch.randn(n, device="cuda") for _ in range(8)]
    ys = [torch.empty_like(x) for x in xs]

    def run(i: int) -> None:
        scale[(n // 1024,)](xs[i], ys[i], n, BLOCK=1024)

    t = time_fn(run, 8, bytes_per_set=8 * n, samples=30)
    if torch.version.hip is None:
        assert t.method == METHOD_GRAPH, t.note
    else:
        assert t.method in (METHOD_GRAPH, METHOD_EVENTS)
    assert not t.functional_only and t.n_samples == 30
    assert 0 < t.min_us <= t.median_us < 1000
    assert t.cache_policy == "rotate_4MiB_x8"
    if t.method == METHOD_GRAPH:  # a few-us kernel: sized by device time, many calls a graph
        assert t.calls_per_sample >= 50, t
    assert all(torch.equal(y, 2 * x) for x, y in zip(xs, ys))
    events = time_fn(run, 8, bytes_per_set=8 * n, samples=30, method="events")
    assert events.method == METHOD_EVENTS and events.median_us > 0
