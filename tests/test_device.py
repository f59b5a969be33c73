"""Device model: arch parsing, FP8 flavour table, detection from (faked) properties, ceilings."""

import json
from types import SimpleNamespace

import pytest
import torch

from qsa.measure import device as dev
from qsa.measure.device import (Ceilings, DeviceInfo, NoFp8Error, UnknownArchError, cpu_device,
                                detect_device, device_slug, fp8_flavour_for_arch,
                                load_or_measure_ceilings, measure_ceilings, parse_arch)

MiB = 1 << 20


@pytest.mark.parametrize("name, arch", [
    ("gfx950:sramecc+:xnack-", "gfx950"),
    ("gfx942:sramecc+:xnack-", "gfx942"),
    ("gfx90a", "gfx90a"),
    ("gfx1201", "gfx1201"),
    (" gfx942:xnack+ ", "gfx942"),
])
def test_parse_rocm_arch(name, arch):
    assert parse_arch(gcn_arch_name=name) == arch


@pytest.mark.parametrize("cap, arch", [((9, 0), "sm90"), ((8, 9), "sm89"), ((10, 0), "sm100"),
                                       ((12, 1), "sm121")])
def test_parse_cuda_arch(cap, arch):
    assert parse_arch(capability=cap) == arch


@pytest.mark.parametrize("kwargs", [{}, {"gcn_arch_name": "gfx950", "capability": (9, 0)},
                                    {"gcn_arch_name": ""}, {"gcn_arch_name": "sm90"},
                                    {"gcn_arch_name": "gfx950:sramecc"},
                                    {"capability": (9, 10)}])
def test_parse_arch_rejects(kwargs):
    with pytest.raises(ValueError):
        parse_arch(**kwargs)


@pytest.mark.parametrize("arch, dtype, fmax", [
    ("sm90", torch.float8_e4m3fn, 448.0),
    ("sm89", torch.float8_e4m3fn, 448.0),
    ("sm100", torch.float8_e4m3fn, 448.0),
    ("gfx950", torch.float8_e4m3fn, 448.0),
    ("gfx942", torch.float8_e4m3fnuz, 240.0),
    ("cpu", torch.float8_e4m3fn, 448.0),
])
def test_fp8_flavour_table(arch, dtype, fmax):
    assert fp8_flavour_for_arch(arch) == (dtype, fmax)


def test_fp8_flavour_errors():
    with pytest.raises(NoFp8Error, match="sm80"):
        fp8_flavour_for_arch("sm80")
    with pytest.raises(NoFp8Error, match="gfx90a"):
        fp8_flavour_for_arch("gfx90a")
    for arch in ("gfx1201", "gfx999", "tpu"):
        with pytest.raises(UnknownArchError, match=arch):
            fp8_flavour_for_arch(arch)


@pytest.mark.parametrize("vendor, name, arch, slug", [
    ("nvidia", "NVIDIA H200", "sm90", "nvidia-h200"),
    ("nvidia", "NVIDIA H100 80GB HBM3", "sm90", "nvidia-h100-80gb-hbm3"),
    ("amd", "AMD Instinct MI355X", "gfx950", "amd-mi355x"),
    ("amd", "", "gfx950", "amd-gfx950"),
    ("cpu", "cpu", "cpu", "cpu-interpreter"),
])
def test_device_slug(vendor, name, arch, slug):
    assert device_slug(vendor, name, arch) == slug


def test_detect_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = detect_device()
    assert (d.vendor, d.arch, d.backend, d.slug) == ("cpu", "cpu", "interpreter",
                                                     "cpu-interpreter")
    assert d.fp8_dtype == torch.float8_e4m3fn and not d.is_gpu
    rec = json.loads(json.dumps(d.as_record()))
    assert rec["fp8_dtype"] == "float8_e4m3fn" and rec["slug"] == "cpu-interpreter"


def _fake_gpu(monkeypatch, hip: str | None, **props):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(**props))
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(dev, "_driver_version", lambda vendor: "test")


def test_detect_mi355x_from_properties(monkeypatch):
    _fake_gpu(monkeypatch, "7.0.1", gcnArchName="gfx950:sramecc+:xnack-",
              name="AMD Instinct MI355X", multi_processor_count=256, total_memory=288 << 30,
              L2_cache_size=4 * MiB)
    d = detect_device()
    assert (d.vendor, d.arch, d.backend, d.slug) == ("amd", "gfx950", "hip", "amd-mi355x")
    assert d.llc_bytes == 256 * MiB  # the Infinity Cache, not the reported L2
    assert (d.fp8_dtype, d.fp8_max, d.warp_size) == (torch.float8_e4m3fn, 448.0, 64)
    assert d.unit_count == 256 and d.runtime_version == "hip 7.0.1"


def test_detect_mi300x_uses_fnuz(monkeypatch):
    _fake_gpu(monkeypatch, "6.4", gcnArchName="gfx942:sramecc+:xnack-",
              name="AMD Instinct MI300X", multi_processor_count=304, total_memory=192 << 30,
              L2_cache_size=4 * MiB)
    d = detect_device()
    assert (d.fp8_dtype, d.fp8_max, d.llc_bytes) == (torch.float8_e4m3fnuz, 240.0, 256 * MiB)


def test_detect_h200_from_properties(monkeypatch):
    _fake_gpu(monkeypatch, None, major=9, minor=0, name="NVIDIA H200",
              multi_processor_count=132, total_memory=141 << 30, L2_cache_size=50 * MiB,
              warp_size=32)
    d = detect_device()
    assert (d.vendor, d.arch, d.backend, d.slug) == ("nvidia", "sm90", "cuda", "nvidia-h200")
    assert (d.llc_bytes, d.warp_size, d.fp8_max) == (50 * MiB, 32, 448.0)


def test_detect_a100_has_no_fp8(monkeypatch):
    _fake_gpu(monkeypatch, None, major=8, minor=0, name="NVIDIA A100-SXM4-80GB",
              multi_processor_count=108, total_memory=80 << 30, L2_cache_size=40 * MiB)
    d = detect_device()
    assert d.fp8_dtype is None and d.fp8_max is None and d.warp_size == 32


def test_detect_unknown_amd_arch_raises(monkeypatch):
    _fake_gpu(monkeypatch, "7.0", gcnArchName="gfx1201", name="AMD Radeon",
              multi_processor_count=64, total_memory=16 << 30, L2_cache_size=8 * MiB)
    with pytest.raises(UnknownArchError, match="gfx1201"):
        detect_device()


def _gpu_info(name: str = "NVIDIA H200") -> DeviceInfo:
    return DeviceInfo(vendor="nvidia", name=name, arch="sm90", unit_count=132,
                      memory_bytes=141 << 30, llc_bytes=50 * MiB,
                      fp8_dtype=torch.float8_e4m3fn, fp8_max=448.0, warp_size=32,
                      backend="cuda", driver_version="test", runtime_version="cuda 12.8",
                      torch_version=torch.__version__, triton_version="3.6.0")


def _ceilings(slug: str, copy: float) -> Ceilings:
    return Ceilings(device_slug=slug, copy_gbps=copy, read_gbps=4262.0, bf16_tflops=797.0,
                    fp8_tflops=None, fp8_note="test", method={"copy": {"median_us": 1.0}},
                    date="2026-01-01T00:00:00+00:00", versions={"torch": "x"})


def test_ceilings_json_round_trip():
    c = _ceilings("nvidia-h200", 4285.0)
    assert Ceilings.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="fields"):
        Ceilings.from_json(json.dumps({"copy_gbps": 1.0}))


def test_ceilings_lookup_prefers_the_committed_copy(tmp_path):
    d = _gpu_info()
    profiles, cache = tmp_path / "profiles", tmp_path / "cache"
    for root, copy in ((profiles, 4285.0), (cache, 1.0)):
        (root / d.slug).mkdir(parents=True)
        (root / d.slug / "ceilings.json").write_text(_ceilings(d.slug, copy).to_json())
    assert load_or_measure_ceilings(d, cache, profiles_root=profiles).copy_gbps == 4285.0
    (profiles / d.slug / "ceilings.json").unlink()
    assert load_or_measure_ceilings(d, cache, profiles_root=profiles).copy_gbps == 1.0


def test_ceilings_of_another_device_are_refused(tmp_path):
    d = _gpu_info()
    (tmp_path / d.slug).mkdir()
    (tmp_path / d.slug / "ceilings.json").write_text(_ceilings("amd-mi355x", 1.0).to_json())
    with pytest.raises(ValueError, match="amd-mi355x"):
        load_or_measure_ceilings(d, tmp_path / "cache", profiles_root=tmp_path)


def test_cpu_gets_no_ceilings(tmp_path):
    assert load_or_measure_ceilings(cpu_device(), tmp_path, profiles_root=tmp_path) is None
    with pytest.raises(ValueError, match="CPU"):
        measure_ceilings(cpu_device())


def test_the_gpus_measured_on_have_datasheet_figures():
    """The H100 SXM (the card the GPU host lends most) beside the H200: same die, same SMs,
    L2 and matrix rates, slower HBM3."""
    h100, h200 = dev.DATASHEETS["nvidia-h100-80gb-hbm3"], dev.DATASHEETS["nvidia-h200"]
    assert device_slug("nvidia", "NVIDIA H100 80GB HBM3", "sm90") == "nvidia-h100-80gb-hbm3"
    assert (h100.hbm_gbps, h200.hbm_gbps) == (3350.0, 4800.0)
    for d in (h100, h200):
        assert (d.llc_bytes, d.compute_units, d.bf16_tflops, d.fp8_tflops) == (
            50_000_000, 132, 989.4, 1978.9)
    assert {"amd-mi355x", "amd-mi300x"} <= set(dev.DATASHEETS)


@pytest.mark.gpu
def test_measured_ceilings_are_plausible():
    d = detect_device()
    if d.slug not in dev.DATASHEETS:
        pytest.skip(f"no datasheet bandwidth for {d.slug}")
    c = measure_ceilings(d, samples=10)
    peak = dev.DATASHEETS[d.slug].hbm_gbps
    assert 0.3 * peak <= c.copy_gbps <= peak, c
    assert 0.3 * peak <= c.read_gbps <= peak, c
    assert c.bf16_tflops > 0
    assert c.fp8_tflops is None or c.fp8_tflops > 0
    assert c.method["copy"]["timing_method"] in ("graph_replay", "device_events")
    assert Ceilings.from_json(c.to_json()) == c
