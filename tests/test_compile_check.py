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
from qsa.workbench.compile_check import PASSING

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
    assert set(df["arch"]) == {"sm90", "gfx950"} and df["status"].isin(PASSING).all()
    # a spill passes only in an entry the tuner timed on that arch (sm90's FP8 shared entry)
    assert (df["registers"] > 0).all() and (df.loc[df["status"] == "ok", "spill_bytes"] == 0).all()
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
    entry = t["sm90"]["fp8"]["32"]  # a Triton entry (buckets 128 and 256 run the Gluon kernel)
    entry["meta"].update(BLOCK_N=128, PV_HALVES=1, SPLIT_RESIDENT_PER_SM=2)  # a pipelined loop
    entry["num_warps"], entry["num_stages"] = 4, 6
    # five buffered 128-token FP8 K/V tiles, 64 KiB each: past sm90's 227 KiB
    path.write_text(json.dumps(t))
    out = tmp_path / "cc.csv"
    res = _check(out, "--arch", "sm90", "--ops", "sparse_gqa_decode",
                 env={"QSA_CONFIG_DIR": str(tables)})
    assert res.returncode == 1
    df = pd.read_csv(out)
    bad = df[~df["status"].isin(PASSING)]  # tuned entries that spill pass (measured there)
    assert set(bad["bucket"]) == {32} and set(bad["status"]) == {"exceeds shared memory"}
    assert "sm90 sparse_gqa_decode fp8 bucket 32: exceeds shared memory" in res.stdout


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


def test_loop_opcodes_of_a_warp_specialized_kernel_are_its_compute_loop():
    """The dispatch loop of a warp-specialized kernel spans its partitions and their EXITs; the
    main loop is the longest partition loop (here the compute warps' MMA loop)."""
    from qsa.workbench.compile_check import loop_opcodes

    sass = """
.L_x_0:
        /*0000*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;
.L_x_1:
        /*0010*/                   LDGSTS.E [R2], desc[UR4][R4.64] ;
        /*0020*/               @P1 BRA `(.L_x_1) ;
        /*0030*/                   EXIT ;
.L_x_2:
        /*0040*/                   LDSM.16.M88.4 R8, [R6] ;
        /*0050*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0060*/                   FMUL R14, R12, R13 ;
        /*0070*/               @P2 BRA `(.L_x_2) ;
        /*0080*/                   EXIT ;
        /*0090*/               @P0 BRA `(.L_x_0) ;
"""
    assert loop_opcodes(sass) == ["LDSM.16.M88.4", "HMMA.16816.F32", "FMUL", "BRA"]


@pytest.mark.slow
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


SASS_FIXTURE = REPO / "tests" / "fixtures" / "sass" / "scale_add_sm90.sass"


def test_the_opcode_histogram_of_a_compiled_kernel_leaves_out_its_padding():
    """`scale_add_sm90.sass`: `nvdisasm -c` of this kernel, compiled for sm90 on the CPU
    (Triton 3.6, signature x/y *fp32, n i32, alpha fp32; BLOCK 128, one warp):

        @triton.jit
        def scale_add(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            for start in range(0, n, BLOCK * tl.num_programs(0)):
                offs = start + pid * BLOCK + tl.arange(0, BLOCK)
                m = offs < n
                tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * alpha + 1.0, mask=m)

    43 instructions up to the last EXIT; the branch-to-self and 12 NOPs after it are padding."""
    from qsa.workbench.compile_check import loop_opcodes, sass_opcodes

    sass = SASS_FIXTURE.read_text()
    hist = sass_opcodes(sass)
    assert sum(hist.values()) == 43 and "NOP" not in hist
    assert hist["LDG.E"] == hist["STG.E"] == hist["FFMA"] == 4  # the loop, unrolled 4 times
    assert hist["EXIT"] == 2 and hist["BRA"] == 1  # the loop's back edge, not the trap
    loop = loop_opcodes(sass)
    assert len(loop) == 27 and loop[-1] == "BRA" and loop.count("LDG.E") == 4


def test_the_amdgpu_histogram_counts_instruction_lines_only():
    from qsa.workbench.compile_check import amdgcn_opcodes

    asm = ("\t.text\n\t.globl\tk ; -- Begin function k\nk:\n; %bb.0:\n"
           "\t.loc\t1 6 0 prologue_end ; k.py:6:0\n\ts_load_dwordx2 s[2:3], s[0:1], 0x0\n"
           "\ts_waitcnt lgkmcnt(0)\n.LBB0_1:\n\tv_fma_f32 v2, s7, v6, 1.0\n"
           "\tglobal_store_dword v[0:1], v2, off\n\ts_waitcnt vmcnt(0)\n\ts_endpgm\n"
           "\t.amdhsa_kernel k\n\t\t.amdhsa_next_free_vgpr 8\n\t.end_amdhsa_kernel\n"
           "; NumVgprs: 8\n")
    assert amdgcn_opcodes(asm) == {"s_load_dwordx2": 1, "s_waitcnt": 2, "v_fma_f32": 1,
                                   "global_store_dword": 1, "s_endpgm": 1}


def _row(bucket: int, launch: int, registers: int, **kw) -> dict:
    return {"arch": "sm90", "op": "sparse_gqa_decode", "index_format": "bf16",
            "kv_format": "fp8", "fmt": "fp8", "bucket": bucket, "launch": launch,
            "config": '{"num_warps": 4}', "kernel": f"k{bucket}_{launch}",
            "registers": registers, "spill_bytes": 0, "shared_bytes": 1024, "status": "ok", **kw}


def test_the_diff_pairs_kernels_by_config_and_launch_and_names_what_moved():
    """Kernels are paired by op, formats, table entry and their place among the entry's
    launches (names change with every constexpr); counts and the opcodes that moved most are
    reported, a table entry that changed is flagged, and a failed compile is no kernel."""
    from qsa.workbench.compile_check import diff_checks

    a = [_row(1, 0, 120, opcodes={"HGMMA.64x64": 8, "LDG.E.128": 4, "FFMA": 10}),
         _row(1, 1, 30, opcodes={"FADD": 2}), _row(256, 0, 200, opcodes={"FADD": 1}),
         {"arch": "sm90", "op": "kv_store", "status": "error", "error": "did not compile"}]
    b = [_row(1, 0, 128, opcodes={"HGMMA.64x128": 4, "HGMMA.64x64": 8, "LDG.E.128": 2,
                                  "FFMA": 10}),
         _row(1, 1, 30, opcodes={"FADD": 2}), _row(4096, 0, 90, opcodes={"FADD": 1}),
         _row(256, 0, 200, opcodes={"FADD": 1}, config='{"num_warps": 8}')]
    d = diff_checks(a, b).set_index(["bucket", "launch"])
    assert d.loc[(1, 0), "change"] == "changed" and d.loc[(1, 0), "d_registers"] == 8
    assert d.loc[(1, 0), "opcodes"] == "HGMMA +4, LDG -2"
    assert d.loc[(1, 1), "change"] == "same" and d.loc[(1, 1), "opcodes"] == ""
    assert d.loc[(256, 0), "change"] == "changed" and d.loc[(256, 0), "config"] == "changed"
    assert d.loc[(4096, 0), "change"] == "only in B" and len(d) == 4


def test_compile_check_diff_reads_a_table_or_its_json_and_refuses_compile_options(tmp_path):
    """`--diff A B` takes a CSV written before the launch column (launch order then comes from
    the row order) against a `--sass` JSON; it compiles nothing, so compile options are
    refused."""
    from typer.testing import CliRunner

    from qsa.cli import app

    old = tmp_path / "old" / "compile_check.csv"
    old.parent.mkdir()
    pd.DataFrame([{k: v for k, v in _row(1, i, r).items() if k != "launch"}
                  for i, r in ((0, 120), (1, 30))]).to_csv(old, index=False)
    new = tmp_path / "new" / "compile_check.sass.json"
    new.parent.mkdir()
    new.write_text(json.dumps({"triton": "3.6.0", "rows": [
        _row(1, 0, 112, opcodes={"FFMA": 1}), _row(1, 1, 30, opcodes={"FADD": 2})]}))
    runner = CliRunner()
    res = runner.invoke(app, ["compile-check", "--diff", str(old.parent), str(new)])
    assert res.exit_code == 0, res.output
    assert "2 compiled kernels; changed 1 · same 1 · only in A 0 · only in B 0" in res.output
    assert "120 -> 112" in res.output
    res = runner.invoke(app, ["compile-check", "--diff", str(old), str(new), "--arch", "sm90"])
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "--diff compiles nothing; drop --arch" in flat


@pytest.mark.slow
def test_sass_histograms_are_written_beside_the_table_and_diff_to_nothing(tmp_path):
    out = tmp_path / "cc.csv"
    res = _check(out, "--arch", "sm90", "--ops", "compress", "--sass")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads((tmp_path / "cc.sass.json").read_text())
    table = pd.read_csv(out)
    assert len(doc["rows"]) == len(table) > 0 and "opcodes" not in table
    for row, (_, line) in zip(doc["rows"], table.iterrows()):
        assert sum(row["opcodes"].values()) == row["instructions"] == line["instructions"]
        assert 0 < row["loop_instructions"] < row["instructions"]
        assert row["opcodes"]["EXIT"] >= 1 and "NOP" not in row["opcodes"]
    res = _check(tmp_path / "unused.csv", "--diff", str(out), str(tmp_path / "cc.sass.json"))
    assert res.returncode == 2  # --out given with --diff
    res = subprocess.run([sys.executable, "-m", "qsa.cli", "compile-check", "--diff", str(out),
                          str(tmp_path / "cc.sass.json")], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 0 and f"same {len(table)} · only in A 0" in res.stdout
