"""Per-step roll-up and the tuner, at interpreter sizes."""

import json
import shutil

import pandas as pd
import pytest

from qsa.configs import BlockConfig, ConfigError, get_config
from qsa.presets import get_preset
from qsa.workbench import step as step_mod
from qsa.workbench import tune as tune_mod
from support import tiny_preset

TINY = tiny_preset()


def test_step_calls_follow_the_model(monkeypatch):
    monkeypatch.delenv("QSA_STACKED_DECODE_SCORER", raising=False)
    p = get_preset()
    calls = step_mod.step_calls(p, 3, "fp8", "fp8")
    target = [c for c in calls if c.phase == "target"]
    draft = [c for c in calls if c.phase == "draft"]
    assert {c.calls_per_step for c in target} == {12} and {c.rows for c in target} == {4}
    assert {c.calls_per_step for c in draft} == {3} and {c.rows for c in draft} == {1}
    assert {(c.index_format, c.kv_format) for c in draft} == {("bf16", "bf16")}
    assert "score_stacked" in [c.op for c in target]
    monkeypatch.setenv("QSA_STACKED_DECODE_SCORER", "0")
    assert "score_rowwise" in [c.op for c in step_mod.step_calls(p, 3, "bf16", "bf16")]
    assert all(c.phase == "target" for c in step_mod.step_calls(p, 0, "bf16", "bf16"))


def test_step_breakdown_sums(monkeypatch):
    df = step_mod.step_breakdown(TINY, batch=1, context=24, mtp=1, samples=1)
    kernels = df[df["phase"] != "step"]
    total = df[df["kernel"] == "sum of kernels"]["us_per_step"].item()
    assert total == pytest.approx(kernels["us_per_step"].sum())
    assert kernels["share"].sum() == pytest.approx(1.0)
    assert (kernels["us_per_step"] == kernels["us_per_call"] * kernels["calls_per_step"]).all()
    assert len(kernels) == 10  # 5 kernels x (target, draft)
    assert "cache_policy" in kernels  # how many input copies each call rotated


def test_a_steps_calls_draw_their_input_sets_from_one_budget(monkeypatch):
    """The whole-step graph holds every call's inputs at once, so every call of the step is
    prepared inside one shared budget (forced here: without a GPU there is none)."""
    from qsa.workbench import verify

    seen = []

    def forced(points):
        seen.append(points)
        return verify.held_together(points, free_bytes=1 << 30)

    monkeypatch.setattr(step_mod, "held_together", forced)
    drawn = []
    real_take = verify.RotationBudget.take
    monkeypatch.setattr(verify.RotationBudget, "take",
                        lambda self, n: (drawn.append(n), real_take(self, n))[1])
    step_mod.step_breakdown(TINY, batch=1, context=24, mtp=1, samples=1, graph=False)
    assert seen == [10] and len(drawn) == 10 and all(n > 0 for n in drawn)


def test_prefill_calls_are_one_chunk_through_every_layer():
    p = get_preset()
    calls = step_mod.step_calls(p, 3, "fp8", "fp8", phase="prefill", rows=4096)
    target = [c for c in calls if c.phase == "target"]
    draft = [c for c in calls if c.phase == "draft"]
    assert [c.op for c in target] == ["compress", "kv_store", "score_prefill", "topk_expand",
                                      "sparse_gqa_prefill"]
    assert {c.rows for c in calls} == {4096}
    assert {c.calls_per_step for c in target} == {len(p.qsa_layers)}
    # the draft module runs over the chunk once per draft layer, not once per draft token
    assert {c.calls_per_step for c in draft} == {p.draft_layers}
    assert not [c for c in step_mod.step_calls(p, 0, "bf16", "bf16", phase="prefill", rows=8)
                if c.phase == "draft"]
    with pytest.raises(ValueError, match="a prefill chunk needs its rows"):
        step_mod.step_calls(p, 3, "bf16", "bf16", phase="prefill")
    with pytest.raises(ValueError, match="give rows only with phase prefill"):
        step_mod.step_calls(p, 3, "bf16", "bf16", rows=4)
    with pytest.raises(ValueError, match="phase: 'verify' is not one of decode, prefill"):
        step_mod.step_calls(p, 3, "bf16", "bf16", phase="verify")


@pytest.mark.slow
def test_prefill_breakdown_sums():
    df = step_mod.step_breakdown(TINY, batch=1, context=48, mtp=1, samples=1, phase="prefill",
                                 rows=16)
    kernels = df[df["phase"] != "step"]
    assert set(kernels["rows"]) == {16}
    assert {"score_prefill", "sparse_gqa_prefill"} <= set(kernels["kernel"])
    total = df[df["kernel"] == "sum of kernels"]["us_per_step"].item()
    assert total == pytest.approx(kernels["us_per_step"].sum())
    assert len(kernels) == 10  # 5 kernels x (target, draft)


def test_a_step_that_can_not_be_captured_is_not_called_a_graph_replay(monkeypatch):
    """When a call of the step can not be captured, the whole-step timing falls back to
    device events (host gaps included); its row must say so, not read `graph replay`."""
    from qsa.measure.timing import METHOD_EVENTS, Timing

    def fake_measure(prep, config=None, samples=None, twice=False):
        return {"us": 2.0, "method": "graph_replay", "calls_per_sample": 500,
                "sizing": "device_time", "functional_only": False}

    def fake_time(fn, n_sets, method="auto", **kw):
        fn(0)
        return Timing(5.0, 5.0, 5.0, 5.0, 0.0, 1, (5.0,), METHOD_EVENTS, "rotate", 1,
                      note="graph capture failed (KernelInputError: ...); used device events")

    monkeypatch.setattr(step_mod, "measure_prepared", fake_measure)
    monkeypatch.setattr(step_mod, "time_fn", fake_time)
    df = step_mod.step_breakdown(TINY, batch=1, context=24, mtp=0)
    whole = df[df["phase"] == "step"].set_index("kernel")
    assert "graph replay" not in whole.index
    row = whole.loc[f"whole step ({METHOD_EVENTS})"]
    assert row["method"] == METHOD_EVENTS and "capture failed" in row["note"]
    assert whole.loc["sum of kernels", "method"] == "graph_replay"  # the calls were captured
    assert set(df.loc[df["phase"] != "step", "sizing"]) == {"device_time"}


def test_config_space_comes_from_the_ops_schema():
    base = BlockConfig({"BLOCK_N": 64, "HOIST_Q_MIN_TILES": 4, "MAX_TILES": 2,
                        "PROGRAMS_PER_UNIT": 8}, 4, 2)
    cuda = tune_mod.config_space("score_stacked", base, "cuda", max_candidates=500)
    hip = tune_mod.config_space("score_stacked", base, "hip", max_candidates=500)
    assert cuda[0] == base
    assert all(not c.amd for c in cuda)
    assert hip[0] == base and all("waves_per_eu" in c.amd for c in hip[1:])
    assert {c.meta["BLOCK_N"] for c in cuda} == {32, 64, 128}
    assert {c.meta["MAX_TILES"] for c in cuda} == {2, 4}  # not below the schema's floor
    small = tune_mod.config_space("score_stacked", base, "cuda", max_candidates=5)
    assert len(small) == 5 and small[0] == base
    odd = BlockConfig(base.meta, 16, 7)  # launch options outside the searched axes
    assert tune_mod.config_space("score_stacked", odd, "cuda")[0] == odd
    # warps: 2, 4, 8 and half and double the entry's, up to 1,024 threads per program
    many = BlockConfig(base.meta, 16, 2)
    assert {c.num_warps for c in tune_mod.config_space("score_stacked", many, "cuda", 500)} \
        == {2, 4, 8, 16, 32}
    assert {c.num_warps for c in tune_mod.config_space("score_stacked", many, "hip", 500)} \
        == {2, 4, 8, 16}
    assert {c.num_warps for c in cuda} == {2, 4, 8}
    # a key outside the op's schema is refused, not searched
    with pytest.raises(ConfigError, match=r"score_stacked: meta keys \['SPLIT'\] are not in "):
        tune_mod.config_space("score_stacked", base.with_meta(SPLIT=1), "cuda")
    # a switch is tried on and off, whichever way the entry has it; a count of 1 is doubled
    flags = BlockConfig({"BLOCK_N": 64, "SLOTS": 1, "PV_HALVES": 0, "SPLIT_MIN_BLOCKS": 1}, 4, 2)
    space = tune_mod.config_space("sparse_gqa_decode", flags, "cuda", max_candidates=500)
    assert {(c.meta["SLOTS"], c.meta["PV_HALVES"]) for c in space} == {(0, 0), (0, 1), (1, 0),
                                                                      (1, 1)}
    assert {c.meta["SPLIT_MIN_BLOCKS"] for c in space} == {1, 2}
    # rows per program: from 1 doubled, at most the schema's 8; the union threshold held
    rows = BlockConfig({"BLOCK_N": 32, "ROWS": 1, "SHARE_MAX_UNION": 200}, 4, 2)
    space = tune_mod.config_space("sparse_gqa_prefill", rows, "cuda", max_candidates=500)
    assert {c.meta["ROWS"] for c in space} == {1, 2}
    assert {c.meta["SHARE_MAX_UNION"] for c in space} == {200}
    space = tune_mod.config_space("sparse_gqa_prefill", rows.with_meta(ROWS=4), "cuda", 500)
    assert {c.meta["ROWS"] for c in space} == {2, 4, 8}
    space = tune_mod.config_space("sparse_gqa_prefill", rows.with_meta(ROWS=8), "cuda", 500)
    assert {c.meta["ROWS"] for c in space} == {4, 8}
    # programmatic dependent launch: tried on sm90 and newer only
    pdl = flags.with_meta(PDL=0)
    for backend, arch, tried in (("cuda", "sm90", {0, 1}), ("cuda", "sm100", {0, 1}),
                                 ("cuda", "sm80", {0}), ("hip", "gfx950", {0}),
                                 ("interpreter", "default", {0})):
        space = tune_mod.config_space("sparse_gqa_decode", pdl, backend, 500, arch)
        assert {c.meta["PDL"] for c in space} == tried, (backend, arch)
        assert {c.meta["SLOTS"] for c in space} == {0, 1}


def test_table_seeds_join_the_space_after_the_current_entry(monkeypatch, tmp_path):
    """Other entries of the same kernel and format (this arch's buckets nearest first, then the
    defaults, at most MAX_SEEDS) are tried right after the current entry: a neighbourhood can
    not reach them. Entries with other meta keys, or a warp count the backend can not launch,
    are left out."""
    def entry(block_n, warps, **meta):
        return {"meta": {"BLOCK_N": block_n, "PV_HALVES": 0, **meta}, "num_warps": warps,
                "num_stages": 2}
    base = BlockConfig.from_dict(entry(64, 4))
    table = {"sm90": {"fp8": {"128": entry(64, 4), "4096": entry(16, 8), "256": entry(32, 8),
                              "512": entry(64, 4, NUM_SPLITS=2)},
                      "bf16": {"1": entry(256, 2)}},
             "default": {"fp8": {"1": entry(32, 2)}},
             "gfx950": {"fp8": {"128": {**entry(128, 32), "amd": {"kpack": 2}},
                                "256": {**entry(256, 4), "amd": {"kpack": 2}}}}}
    (tmp_path / "sparse_gqa_decode.json").write_text(json.dumps(table))
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    seeds = tune_mod.table_seeds("sparse_gqa_decode", "sm90", "fp8", base, 128, "cuda")
    # nearest bucket first (256, then 4096), then the default; the current entry, other meta
    # keys, other formats and archs are left out
    assert seeds == [BlockConfig.from_dict(e) for e in (entry(32, 8), entry(16, 8),
                                                        entry(32, 2))]
    space = tune_mod.config_space("sparse_gqa_decode", base, "cuda", 500, "sm90", seeds)
    assert space[:4] == [base, *seeds]
    assert len({json.dumps(c.as_dict(), sort_keys=True) for c in space}) == len(space)
    assert tune_mod.config_space("sparse_gqa_decode", base, "cuda", 2, "sm90", seeds) \
        == [base, seeds[0]]
    monkeypatch.setattr(tune_mod, "MAX_SEEDS", 1)
    assert tune_mod.table_seeds("sparse_gqa_decode", "sm90", "fp8", base, 128, "cuda") \
        == seeds[:1]
    monkeypatch.setattr(tune_mod, "MAX_SEEDS", 3)
    # an arch without a section of its own still gets the defaults; on ROCm a seed keeps its
    # own AMD launch keys, and 32 warps (2,048 threads of wave64) are not launched
    assert tune_mod.table_seeds("sparse_gqa_decode", "gfx942", "fp8", base, 128, "hip") \
        == [seeds[2]]
    hip = tune_mod.table_seeds("sparse_gqa_decode", "gfx950", "fp8", base, 128, "hip")
    assert [(c.meta["BLOCK_N"], c.amd) for c in hip] == [(256, {"kpack": 2}), (32, {})]


def test_tune_tries_the_table_seeds(monkeypatch, tmp_path):
    """`tune` asks for the seeds of the coordinate it tunes and times them after the entry."""
    asked = []
    seed = BlockConfig({"GROUPS": 64}, 2, 1)

    def seeds(kernel, arch, fmt, base, bucket, backend):
        asked.append((kernel, fmt, bucket, backend))
        return [BlockConfig({**base.meta, **seed.meta}, seed.num_warps, seed.num_stages,
                            base.amd)]

    timed = []
    monkeypatch.setattr(tune_mod, "table_seeds", seeds)
    monkeypatch.setattr(tune_mod, "measure_prepared",
                        lambda prep, cfg, samples=None, twice=False: (
                            timed.append(cfg), {"us": 1.0, "p10_us": 1.0, "p90_us": 1.0,
                                                "iqr_us": 0.0, "method": "events",
                                                "functional_only": True})[1])
    tune_mod.tune("compress", preset=TINY, batch=1, context=64, rows=1, max_candidates=2,
                  samples=1, progress=False)
    assert asked and asked[0][0] == "compress" and asked[0][3] == "interpreter"
    assert timed[1].meta["GROUPS"] == 64 and timed[1].num_warps == 2


def test_tune_records_failures_and_refuses_interpreter_winners(monkeypatch, tmp_path):
    real = tune_mod.measure_prepared
    calls = []

    def flaky(prep, cfg, samples=None, twice=False):
        calls.append((cfg, twice))
        if len(calls) == 2:
            raise RuntimeError("out of resources: shared memory")
        return real(prep, cfg, samples=1, twice=twice)

    monkeypatch.setattr(tune_mod, "measure_prepared", flaky)
    df = tune_mod.tune("score_rowwise", preset=TINY, batch=1, context=24, rows=1,
                       max_candidates=3, progress=False)
    assert list(df["status"]) == ["ok", "RuntimeError", "ok"]
    assert [t for _, t in calls] == [True, False, False]  # the current entry is timed twice
    assert df["noise_rel"].iloc[0] >= 0
    assert "shared memory" in df["error"].iloc[1]
    with pytest.raises(RuntimeError, match="interpreter"):
        tune_mod.write_winner(df, "score_rowwise", "default", "bf16", 1)


def _tuned(us, iqr, noise_rel=0.01):
    cfgs = [BlockConfig({"BLOCK_N": 64}, 4, 2), BlockConfig({"BLOCK_N": 128}, 8, 3)]
    df = pd.DataFrame({"status": ["ok", "ok"], "is_current": [True, False], "us": us,
                       "iqr_us": iqr, "noise_rel": [noise_rel, None],
                       "p10_us": [u * 0.98 for u in us], "p90_us": [u * 1.02 for u in us],
                       "method": ["graph_replay"] * 2, "functional_only": [False, False],
                       "config": [json.dumps(c.as_dict()) for c in cfgs]})
    return df, cfgs


def test_write_winner_stores_provenance(monkeypatch, tmp_path):
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    df, cfgs = _tuned([10.0, 7.5], [0.2, 0.1])
    df["batch"], df["context"], df["rows"] = 32, 32768, 4  # the point's record, as `tune` adds
    won = tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256)
    assert won == cfgs[1]
    choice = get_config("score_stacked", "sm90", "bf16", 200, table_dir=tmp_path)
    assert choice.config == cfgs[1] and choice.tuned
    assert choice.provenance["us"] == 7.5 and choice.provenance["previous_us"] == 10.0
    assert choice.provenance["verdict"] == "faster"
    assert choice.provenance["shape"] == {"batch": 32, "context": 32768, "rows": 4}
    assert "earlier" not in choice.provenance  # the bucket held no tuned entry before
    # A second run that confirms the entry keeps the first run's gain, one level deep.
    df2, _ = _tuned([7.5, 7.6], [0.1, 0.1])
    df2["config"] = [json.dumps(cfgs[1].as_dict()), json.dumps(cfgs[0].as_dict())]
    assert tune_mod.write_winner(df2, "score_stacked", "sm90", "bf16", 256) == cfgs[1]
    prov = get_config("score_stacked", "sm90", "bf16", 256, table_dir=tmp_path).provenance
    assert prov["verdict"] == "confirmed"
    earlier = prov["earlier"]
    assert earlier["us"] == 7.5 and earlier["previous_us"] == 10.0
    assert earlier["verdict"] == "faster" and earlier["config"] == cfgs[1].as_dict()
    assert earlier["shape"] == {"batch": 32, "context": 32768, "rows": 4}
    assert "earlier" not in earlier


def test_stacked_scorer_calls_of_one_context_and_other_batches_have_their_own_entries():
    """The stacked scorer's grid covers requests x groups: a batch-32 call at the context of a
    batch-8 one is a grid four times larger, and must not be served the batch-8 entry."""
    from qsa.workbench.ops import Point, config_coordinate, prepare

    sizes = {b: config_coordinate(prepare(Point("score_stacked", TINY, b, 160, 2))).size
             for b in (2, 8)}
    assert sizes == {2: 2 * 40, 8: 8 * 40}  # 160 tokens: 40 groups per request


def test_a_win_inside_the_noise_confirms_the_current_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    df, cfgs = _tuned([10.0, 9.9], [0.1, 0.1], noise_rel=0.03)  # 1% faster, 3% repeat noise
    assert tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256) == cfgs[0]
    choice = get_config("score_stacked", "sm90", "bf16", 256, table_dir=tmp_path)
    assert choice.provenance["verdict"] == "confirmed" and choice.provenance["us"] == 10.0


def _recheck(current_us, winner_us, noise_rel=0.02, functional_only=False):
    return tune_mod.Recheck(current_us, winner_us, noise_rel, functional_only, 1, "NVIDIA H200")


def test_a_winner_confirmed_in_a_fresh_process_is_written_with_both_timings(monkeypatch,
                                                                            tmp_path):
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    df, cfgs = _tuned([10.0, 7.5], [0.2, 0.1])
    asked = []

    def recheck(cur, win):
        asked.append((cur, win))
        return _recheck(10.2, 7.6)

    assert tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256,
                                 recheck=recheck) == cfgs[1]
    assert asked == [(cfgs[0], cfgs[1])]  # the current entry against the run's winner
    prov = get_config("score_stacked", "sm90", "bf16", 256, table_dir=tmp_path).provenance
    assert prov["verdict"] == "faster" and prov["recheck"]["winner_us"] == 7.6
    assert prov["recheck"]["current_us"] == 10.2 and "rejected" not in prov


def test_a_winner_the_fresh_process_does_not_confirm_is_not_written(monkeypatch, tmp_path):
    """25% faster in the tuning run, within 1% of the current entry in the re-check (2%
    noise): the current entry stays, confirmed, and the provenance says what was rejected."""
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    df, cfgs = _tuned([10.0, 7.5], [0.2, 0.1])
    won = tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256,
                                recheck=_recheck(10.0, 9.9))
    assert won == cfgs[0]
    prov = get_config("score_stacked", "sm90", "bf16", 256, table_dir=tmp_path).provenance
    assert prov["verdict"] == "confirmed" and prov["us"] == 10.0
    assert prov["rejected"]["config"] == cfgs[1].as_dict()
    assert prov["rejected"]["tuning_us"] == 7.5 and prov["rejected"]["recheck"]["winner_us"] == 9.9
    with pytest.raises(RuntimeError, match="interpreter"):
        tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256,
                              recheck=_recheck(10.0, 7.0, functional_only=True))
    # No winner in the tuning run: nothing to re-check.
    df, _ = _tuned([10.0, 9.9], [0.1, 0.1], noise_rel=0.03)
    tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256,
                          recheck=lambda cur, win: pytest.fail("re-checked a non-winner"))


@pytest.mark.slow
def test_tune_with_write_rechecks_the_winner_in_another_process(monkeypatch, tmp_path):
    """The tuner's write path hands the re-check the point and both configs; the re-check
    itself runs in a child process that verifies and times each config twice."""
    import os

    from qsa.configs import TABLE_DIR
    from qsa.measure.device import detect_device
    from qsa.workbench.ops import Point

    shutil.copytree(TABLE_DIR, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    real = tune_mod.measure_prepared

    def gpu_like(prep, cfg, samples=None, twice=False):  # the second candidate wins clearly
        r = real(prep, cfg, samples=1, twice=twice)
        fast = cfg != cfgs_seen[0] if cfgs_seen else False
        cfgs_seen.append(cfg)
        return {**r, "us": 5.0 if fast else 10.0, "iqr_us": 0.0, "noise_rel": 0.0,
                "functional_only": False}

    cfgs_seen: list = []
    calls = []
    monkeypatch.setattr(tune_mod, "measure_prepared", gpu_like)
    monkeypatch.setattr(tune_mod, "recheck_in_fresh_process",
                        lambda point, cur, win, samples=None, device=None:
                        calls.append((point, cur, win, device)) or _recheck(10.0, 5.0))
    df = tune_mod.tune("score_rowwise", preset=TINY, batch=1, context=24, rows=1,
                       max_candidates=2, progress=False, write=True, device="cpu")
    assert len(calls) == 1 and calls[0][0] == Point("score_rowwise", TINY, 1, 24, 1)
    assert calls[0][3] == "cpu"  # re-checked on the device it was tuned on
    assert calls[0][1] == cfgs_seen[0] and calls[0][2] == cfgs_seen[1]
    prov = get_config("score_rowwise", df["arch"].iloc[0], df["kernel_fmt"].iloc[0],
                      int(df["bucket"].iloc[0]), table_dir=tmp_path).provenance
    assert prov["verdict"] == "faster" and prov["recheck"]["winner_us"] == 5.0
    monkeypatch.undo()
    r = tune_mod.recheck_in_fresh_process(calls[0][0], calls[0][1], calls[0][2], samples=1)
    assert r.pid != os.getpid() and r.functional_only == (not detect_device().is_gpu)
    assert r.current_us > 0 and r.winner_us > 0 and r.noise_rel >= 0


@pytest.mark.parametrize("op", [
    "score_stacked", pytest.param("score_rowwise", marks=pytest.mark.slow), "score_prefill",
    "topk_expand", "compress", "kv_store", pytest.param("sparse_gqa_decode", marks=pytest.mark.slow),
    pytest.param("sparse_gqa_prefill", marks=pytest.mark.slow)])
def test_a_tuned_entry_is_the_one_the_kernel_then_runs(op, monkeypatch, tmp_path):
    """The whole loop on the interpreter: tune a tiny space, write the winner where the tuner
    says, then run the kernel with its table config and see which entry it resolved. The
    winner is forced to the non-current candidate (interpreter times mean nothing), so a
    coordinate that differs from the kernel's own lookup would leave the old entry in use."""
    from qsa.configs import TABLE_DIR
    from qsa.kernels.common import observe_lookups
    from qsa.workbench.ops import Point, config_coordinate, prepare
    from qsa.workbench.registry import find

    shutil.copytree(TABLE_DIR, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    fmt = ("fp8", "fp8") if op in ("kv_store", "sparse_gqa_decode") else ("mxfp4", "bf16")
    # A context of 160 puts the score width (40 groups) and the row count (2) far apart, so a
    # tuner keyed by rows would write where the scorers never look.
    shape = dict(preset=TINY, batch=2, context=160, rows=2, index_format=fmt[0],
                 kv_format=fmt[1])
    df = tune_mod.tune(op, max_candidates=2, samples=1, progress=False, **shape)
    assert list(df["status"]) == ["ok", "ok"], df["error"].tolist()
    df["functional_only"] = False  # stand-in for GPU timings: make the candidate win
    df.loc[0, "us"], df.loc[1, "us"] = 10.0, 5.0
    df["iqr_us"], df["noise_rel"] = 0.0, 0.0
    won = tune_mod.write_winner(df, op, "default", df["kernel_fmt"].iloc[0],
                                int(df["bucket"].iloc[0]))
    assert won == BlockConfig.from_dict(json.loads(df["config"].iloc[1]))
    point = Point(op, TINY, 2, 160, 2, *fmt)
    prep = prepare(point)
    with observe_lookups() as seen:
        prep.check(None)
    table = find(op).table
    used = [s for s in seen if s.kernel == table]
    assert used and all(s.config == won and not s.explicit for s in used)
    # The kernel's own coordinate is where the winner was written, not merely nearest to it.
    assert {s.size for s in used} == {int(df["bucket"].iloc[0])}
    assert config_coordinate(prep).size == int(df["bucket"].iloc[0])
    choice = get_config(table, "default", used[0].fmt, used[0].size, table_dir=tmp_path)
    assert choice.tuned and choice.bucket == int(df["bucket"].iloc[0])


def test_tuning_a_call_that_borrows_another_entry_is_refused_with_the_reason(monkeypatch):
    """FP8 prefill keys decoded once are scored with the BF16 entry's tiles: the call reads
    two entries, a winner written to either would not be what this call alone runs, so the
    tuner refuses and says why instead of tuning one of them."""
    from qsa.kernels.score_prefill import DECODE_ENV
    from qsa.workbench.ops import Point, config_coordinate, prepare

    prep = prepare(Point("score_prefill", TINY, 1, 160, 8, "fp8", "bf16"))
    assert config_coordinate(prep).fmt == "fp8"  # in-tile decode: the FP8 entry alone
    monkeypatch.setenv(DECODE_ENV, "1")
    with pytest.raises(RuntimeError, match=r"saw \[\('score_prefill', 'bf16'.*'fp8'.*BF16 "
                                           r"entry's tiles"):
        config_coordinate(prep)


def test_step_comparison_of_format_pairs(tmp_path):
    """Side-by-side steps: speedups against the first pair, and the figure is written."""
    def frame(idx, kv, attn):
        return pd.DataFrame({
            "phase": ["target", "target", "step", "step"],
            "kernel": ["score_stacked", "sparse_gqa_decode", "sum of kernels", "graph replay"],
            "us_per_step": [100.0, attn, 100.0 + attn, 95.0 + attn],
            "index_format": idx, "kv_format": kv})

    frames = [frame("bf16", "bf16", 300.0), frame("fp8", "fp8", 100.0)]
    cmp = step_mod.step_comparison(frames, tmp_path / "f.png", "test")
    assert list(cmp["sum_us"]) == [400.0, 200.0]
    assert cmp["speedup_sum"].tolist() == [1.0, 2.0]
    assert cmp["speedup_graph"].iloc[1] == pytest.approx(395.0 / 195.0)
    assert (tmp_path / "f.png").stat().st_size > 0


def test_step_formats_option_refuses_bad_pairs():
    import typer

    from qsa.cli import _format_pairs

    assert _format_pairs("bf16/bf16,mxfp4/fp8") == [("bf16", "bf16"), ("mxfp4", "fp8")]
    with pytest.raises(typer.BadParameter, match="INDEX/KV"):
        _format_pairs("fp8")
    with pytest.raises(typer.BadParameter, match="KV format 'mxfp4'"):
        _format_pairs("fp8/mxfp4")


@pytest.mark.slow
def test_tune_all_tunes_each_coordinate_once_and_resumes_from_the_tables(monkeypatch, tmp_path):
    import torch
    import triton

    from qsa.configs import TABLE_DIR, write_entry
    from qsa.measure.device import detect_device
    from qsa.workbench.ops import Point

    shutil.copytree(TABLE_DIR, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    points = [Point("score_stacked", TINY, 2, 160, 2), Point("score_stacked", TINY, 2, 160, 1),
              Point("topk_expand", TINY, 2, 160, 2), Point("kv_store", TINY, 2, 160, 2, "bf16", "fp8")]
    seen = []
    df = tune_mod.tune_all(points, max_candidates=2, samples=1, progress=False,
                           on_row=seen.append)
    assert df["status"].tolist() == ["tuned", "same coordinate as shape 0", "tuned", "tuned"]
    assert [r["status"] for r in seen] == df["status"].tolist()  # handed over as they finish
    assert (df.loc[[0, 2, 3], "candidates"] == 2).all()
    # requests x score width (2 x 40 groups), not rows
    assert df.loc[0, "bucket"] == 80 and df.loc[0, "fmt"] == "bf16"
    # An entry tuned at that coordinate on this device and versions is skipped on a rerun.
    prov = {"tuned": True, "device": detect_device().name, "torch": torch.__version__,
            "triton": triton.__version__}
    write_entry("score_stacked", "default", "bf16", 80, BlockConfig({"BLOCK_N": 16,
                "HOIST_Q_MIN_TILES": 4, "MAX_TILES": 4, "PROGRAMS_PER_UNIT": 1}), prov)
    write_entry("topk", "default", "fp32", int(df.loc[2, "bucket"]),
                get_config("topk", "default", "fp32", 1).config, {**prov, "triton": "0.0"})
    again = tune_mod.tune_all(points[:3], max_candidates=2, samples=1, progress=False)
    assert again["status"].tolist() == ["tuned earlier on this device",
                                        "same coordinate as shape 0", "tuned"]
    forced = tune_mod.tune_all(points[:1], max_candidates=2, samples=1, progress=False,
                               force=True)
    assert forced["status"].tolist() == ["tuned"]
    # An entry that records the shape it was tuned at names it: two shapes that share a
    # coordinate show as such.
    write_entry("score_stacked", "default", "bf16", 80, BlockConfig({"BLOCK_N": 16,
                "HOIST_Q_MIN_TILES": 4, "MAX_TILES": 4, "PROGRAMS_PER_UNIT": 1}),
                {**prov, "shape": {"batch": 8, "context": 40, "rows": 2}})
    named = tune_mod.tune_all(points[:1], max_candidates=2, samples=1, progress=False)
    assert named["status"].tolist() == [
        "tuned earlier on this device (at batch 8, context 40, rows 2)"]


def test_with_changes_to_another_implementation_swaps_its_keys():
    """A candidate of the Gluon implementation takes its own keys and leaves the Triton-only
    ones behind, so the table can hold it; without an impl change, new keys are refused unless
    the schema gives them a default for the entry's implementation."""
    from qsa.configs.schema import schema_of

    schema = schema_of("sparse_gqa_decode")
    base = BlockConfig({"BLOCK_N": 128, "PV_HALVES": 1, "SLOTS": 1, "PDL": 0,
                        "SPLIT_RESIDENT_PER_SM": 2}, 4, 2)
    gluon = {"impl": "gluon", "num_stages": 1,
             "meta": {"BLOCK_N": 64, "STAGES": 3, "LOAD_WARPS": 4, "LOAD_REGS": 96}}
    got = tune_mod.with_changes(base, gluon, schema)
    assert got.impl == "gluon" and got.meta == {"BLOCK_N": 64, "SPLIT_RESIDENT_PER_SM": 2,
                                                "STAGES": 3, "LOAD_WARPS": 4, "LOAD_REGS": 96}
    schema.check_entry(got.as_dict(), "sm90", "fp8", "candidate")
    with pytest.raises(ValueError, match="STAGES"):
        tune_mod.with_changes(base, {"meta": {"STAGES": 3}}, schema)
    # a key the entry leaves at its schema default may be set, on its own implementation only
    assert tune_mod.with_changes(base, {"meta": {"NUM_SPLITS": 8}}, schema).meta["NUM_SPLITS"] == 8
    assert tune_mod.with_changes(got, {"meta": {"SLOTS_AHEAD": 1}}, schema).meta["SLOTS_AHEAD"] == 1
    with pytest.raises(ValueError, match="SLOTS_AHEAD"):
        tune_mod.with_changes(base, {"meta": {"SLOTS_AHEAD": 1}}, schema)
    with pytest.raises(ValueError, match="impl 'gluon' serves bf16 and fp8 entries of arch "
                                         "sm90, not format 'fp8' of arch 'gfx950'"):
        schema.check_entry(got.as_dict(), "gfx950", "fp8", "candidate")


def test_with_changes_refuses_unknown_keys_and_ranked_marks_the_noise():
    base = BlockConfig({"BLOCK_N": 64}, 4, 2)
    assert tune_mod.with_changes(base, {"meta": {"BLOCK_N": 32}, "num_warps": 8}) == \
        BlockConfig({"BLOCK_N": 32}, 8, 2)
    with pytest.raises(ValueError, match="unknown keys"):
        tune_mod.with_changes(base, {"warps": 8})
    with pytest.raises(ValueError, match="BLOKC_N"):
        tune_mod.with_changes(base, {"meta": {"BLOKC_N": 32}})
    df, _ = _tuned([10.0, 9.9], [0.1, 0.1], noise_rel=0.03)  # 1% faster, 3% repeat noise
    r = tune_mod.ranked(df)
    assert r["us"].tolist() == [9.9, 10.0] and not r["beyond_noise"].any()
    df, _ = _tuned([10.0, 8.0], [0.1, 0.1], noise_rel=0.03)
    assert tune_mod.ranked(df)["beyond_noise"].tolist() == [True, False]
