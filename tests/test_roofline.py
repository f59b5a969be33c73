"""Roofline arithmetic against known ceilings."""

import pytest

from qsa.measure.device import Ceilings
from qsa.measure.roofline import Work, roofline_fractions, roofline_record, work_record
from qsa.measure.timing import METHOD_EVENTS, METHOD_HOST, summarize_samples

CEILINGS = Ceilings(device_slug="nvidia-h200", copy_gbps=4000.0, read_gbps=5000.0,
                    bf16_tflops=800.0, fp8_tflops=1600.0, fp8_note="float8_e4m3fn", method={},
                    date="2026-01-01T00:00:00+00:00", versions={})


def test_memory_bound_work():
    f = roofline_fractions(2000.0, Work(bytes_moved=4_000_000_000, flops=1_000_000_000),
                           CEILINGS)
    assert f["achieved_gbps"] == pytest.approx(2000.0)
    assert f["pct_bandwidth"] == pytest.approx(50.0)
    assert f["achieved_tflops"] == pytest.approx(0.5)
    assert f["pct_matrix"] == pytest.approx(0.5 / 800 * 100)
    assert f["bound_us"] == pytest.approx(1000.0) and f["bound_by"] == "memory"
    assert f["pct_of_bound"] == pytest.approx(50.0)
    read = roofline_fractions(2000.0, Work(4_000_000_000, 0), CEILINGS, bandwidth="read")
    assert read["pct_bandwidth"] == pytest.approx(40.0) and read["bound_us"] == 800.0


def test_compute_bound_work():
    flops = 2 * 8192**3
    f = roofline_fractions(2 * flops / 800e6, Work(3 * 2 * 8192**2, flops), CEILINGS)
    assert f["bound_by"] == "compute"
    assert f["pct_matrix"] == pytest.approx(50.0) and f["pct_of_bound"] == pytest.approx(50.0)
    fp8 = roofline_fractions(flops / 1600e6, Work(0, flops), CEILINGS, matrix="fp8")
    assert fp8["pct_matrix"] == pytest.approx(100.0) and fp8["matrix_ceiling"] == "fp8"


def test_missing_fp8_rate_and_bad_inputs_raise():
    no_fp8 = Ceilings(**{**CEILINGS.__dict__, "fp8_tflops": None, "fp8_note": "sm80 no fp8"})
    with pytest.raises(ValueError, match="sm80 no fp8"):
        roofline_fractions(1.0, Work(1, 1), no_fp8, matrix="fp8")
    with pytest.raises(ValueError, match="time_us"):
        roofline_fractions(0.0, Work(1, 1), CEILINGS)
    with pytest.raises(ValueError, match="bandwidth"):
        roofline_fractions(1.0, Work(1, 1), CEILINGS, bandwidth="hbm")
    for bad in ((-1, 0), (0, 1.5), (True, 0)):
        with pytest.raises(ValueError, match="Work"):
            Work(*bad)


def test_work_sums_and_records():
    w = Work(100, 400) + Work(28, 112) * 2
    assert w == Work(156, 624)
    assert work_record(w) == {"bytes_moved": 156, "flops": 624, "intensity_flop_per_byte": 4.0}
    assert Work(0, 5).intensity == float("inf")


def test_roofline_record_labels_functional_rows():
    gpu = summarize_samples([1000.0], method=METHOD_EVENTS, cache_policy="warm",
                            calls_per_sample=1)
    row = roofline_record(gpu, Work(2_000_000_000, 0), CEILINGS)
    assert row["pct_bandwidth"] == pytest.approx(50.0) and row["bytes_moved"] == 2_000_000_000
    cpu = summarize_samples([1000.0], method=METHOD_HOST, cache_policy="warm",
                            calls_per_sample=1, functional_only=True)
    for timing, ceilings in ((cpu, CEILINGS), (gpu, None)):
        functional = roofline_record(timing, Work(2_000_000_000, 0), ceilings)
        assert functional.keys() == row.keys()
        assert functional["pct_bandwidth"] is None and functional["bound_us"] is None
