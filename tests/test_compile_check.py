"""`qsa compile-check`: every table config compiled for GPUs that are not here (sm90, gfx950),
on the CPU, through the kernels' own wrappers; a config that can not run on its target is a
failure with a reason."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from qsa.configs import TABLE_DIR

REPO = Path(__file__).resolve().parents[1]


def _check(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qsa.cli", "compile-check", "--out", str(out),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_sparse_gqa_configs_compile_for_sm90_and_gfx950(tmp_path):
    out = tmp_path / "cc.csv"
    res = _check(out, "--arch", "sm90,gfx950", "--ops", "sparse_gqa_decode")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    df = pd.read_csv(out)
    assert set(df["arch"]) == {"sm90", "gfx950"} and (df["status"] == "ok").all()
    assert (df["registers"] > 0).all() and (df["spill_bytes"] == 0).all()
    # every sm90 table entry of each format was compiled, through the split path (merge kernel)
    entries = json.loads((TABLE_DIR / "sparse_gqa_decode.json").read_text())["sm90"]
    sm90 = df[df["arch"] == "sm90"]
    for fmt, buckets in entries.items():
        assert set(sm90.loc[sm90["fmt"] == fmt, "bucket"]) == {int(b) for b in buckets}
    assert sm90["kernel"].str.startswith("qsa_sparse_gqa_merge").any()
    assert df["kernel"].str.contains("FP8True").any()


@pytest.mark.slow
def test_the_prefill_decode_once_path_is_compiled_too(tmp_path):
    """Long prefill contexts decode FP8/MXFP4 keys once and score the scratch with the BF16
    entry's tiles; the smoke shapes are short, so the check forces that path once per format,
    through the same lookups: the decode kernel and the scorer on bf16 tiles both compile."""
    out = tmp_path / "cc.csv"
    res = _check(out, "--arch", "sm90", "--ops", "score_prefill")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    df = pd.read_csv(out)
    once = df[df["config"].str.startswith("keys decoded once")]
    assert set(once["fmt"]) == {"fp8", "mxfp4"} and (once["status"] == "ok").all()
    for fmt in ("fp8", "mxfp4"):
        names = set(once.loc[once["fmt"] == fmt, "kernel"])
        assert any(n.startswith(f"qsa_score_prefill_decode_FMT{fmt}") for n in names)
        assert any(f"FMT{fmt}_TILE_FMTdense" in n for n in names)


@pytest.mark.slow
def test_a_config_that_does_not_fit_its_target_fails_the_check(tmp_path):
    tables = tmp_path / "tables"
    shutil.copytree(TABLE_DIR, tables)
    path = tables / "sparse_gqa_decode.json"
    t = json.loads(path.read_text())
    entry = t["sm90"]["fp8"]["256"]
    entry["meta"]["BLOCK_N"], entry["num_warps"], entry["num_stages"] = 128, 4, 6
    # five buffered 128-token FP8 K/V tiles, 64 KiB each: past sm90's 227 KiB
    path.write_text(json.dumps(t))
    out = tmp_path / "cc.csv"
    res = _check(out, "--arch", "sm90", "--ops", "sparse_gqa_decode",
                 env={"QSA_CONFIG_DIR": str(tables)})
    assert res.returncode == 1
    df = pd.read_csv(out)
    bad = df[df["status"] != "ok"]
    assert set(bad["bucket"]) == {256} and set(bad["status"]) == {"exceeds shared memory"}
    assert "sm90 sparse_gqa_decode fp8 bucket 256: exceeds shared memory" in res.stdout


def test_an_unknown_arch_is_refused_by_name(tmp_path):
    res = _check(tmp_path / "cc.csv", "--arch", "sm100")
    assert res.returncode == 2 and "sm100" in res.stdout + res.stderr


@pytest.mark.slow
def test_each_target_compiles_in_its_own_process(tmp_path):
    """Triton 3.6 keeps target-dependent state per process: with gfx950 compiled first in the
    same process, gfx942's FP8 (e4m3fnuz) conversions of the K/V store failed an assertion of
    the AMD backend, while a gfx942-only process (a real MI300X host) compiles them."""
    out = tmp_path / "cc.csv"
    res = _check(out, "--arch", "gfx950,gfx942", "--ops", "kv_store")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    df = pd.read_csv(out)
    assert list(dict.fromkeys(df["arch"])) == ["gfx950", "gfx942"]
    fp8 = df[(df["arch"] == "gfx942") & (df["fmt"] == "fp8")]
    assert len(fp8) == 2 and (fp8["status"] == "ok").all() and (fp8["registers"] > 0).all()


def test_a_spill_fails_unless_the_tuner_timed_the_entry_on_that_arch():
    """A spilling config nobody timed on the target is a failure; one the tuner timed there
    (verified, against the entry it replaced) keeps its spill: the cost is in its time."""
    from qsa.workbench import compile_check as cc

    spilled = {"spill_bytes": 904, "shared_bytes": 1024}
    timed = {"provenance": {"tuned": True, "arch": "sm90", "us": 225.8}}
    assert cc._measured_on(timed, "sm90") and not cc._measured_on(timed, "gfx950")
    for entry in ({"provenance": {"source": "hand-picked default", "tuned": False}},
                  {"provenance": {"tuned": True, "arch": "sm90"}}, {}):  # no time: not measured
        assert not cc._measured_on(entry, "sm90")
    assert cc._status(spilled, "sm90", measured=True) == cc.SPILLS_MEASURED
    assert cc.SPILLS_MEASURED in cc.PASSING
    assert cc._status(spilled, "sm90", measured=False) == "spills"
    assert "spills" not in cc.PASSING
    over = {"spill_bytes": 0, "shared_bytes": cc.SHARED_LIMIT["gfx942"] + 1}
    assert cc._status(over, "gfx942", measured=True) == "exceeds shared memory"
    assert cc._status({"spill_bytes": 0, "shared_bytes": 0}, "sm90", measured=False) == "ok"


def test_loop_opcodes_take_the_longest_backward_branch():
    from qsa.workbench.compile_check import loop_opcodes

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IMAD R2, R3, 0x4, RZ ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/              @!P1 LOP3.LUT R5, R4, 0xff, RZ, 0xc0, !PT ;
        /*0060*/               @P2 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""
    assert loop_opcodes(sass) == ["LDG.E", "HMMA.16816.F32", "LOP3.LUT", "BRA"]
    assert loop_opcodes("        /*0000*/                   EXIT ;\n") == []


def test_sm90_loops_compile_a_point_and_list_its_main_loops():
    """`sm90_loops` compiles what a workbench point launches for sm90 (in its own process: the
    test process runs under the interpreter) and gives each kernel's main loop; `skip` leaves
    kernels out by name."""
    code = ("import json; from qsa.presets import as_preset; "
            "from qsa.workbench.compile_check import sm90_loops; "
            "from qsa.workbench.ops import Point; "
            "p = Point('score_prefill', as_preset('qwen3.8-flash-next'), 1, 2048, 64, "
            "index_format='fp8'); "
            "print(json.dumps([[(n, len(o), sum(x.startswith('HGMMA') for x in o)) "
            "for n, _, o in sm90_loops(p, skip)] for skip in ('', 'FMTfp8')]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    every, skipped = json.loads(res.stdout.strip().splitlines()[-1])
    (name, count, mmas), = every  # 512 groups: keys decoded in the tiles, one kernel
    assert name.startswith("qsa_score_prefill_FMTfp8") and count > 100 and mmas > 0
    assert skipped == []
