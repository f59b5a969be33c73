"""Per-step roll-up and the tuner, at interpreter sizes."""

import json

import pandas as pd
import pytest

from qsa.configs import BlockConfig, get_config
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


def test_config_space_keeps_backends_apart():
    base = BlockConfig({"BLOCK_N": 64, "SPLIT": 1}, 4, 2)
    cuda = tune_mod.config_space("score_stacked", base, "cuda", max_candidates=500)
    hip = tune_mod.config_space("score_stacked", base, "hip", max_candidates=500)
    assert cuda[0] == base
    assert all(not c.amd for c in cuda)
    assert hip[0] == base and all("waves_per_eu" in c.amd for c in hip[1:])
    assert {c.meta["BLOCK_N"] for c in cuda} == {32, 64, 128}
    assert {c.meta["SPLIT"] for c in cuda} == {1}
    small = tune_mod.config_space("score_stacked", base, "cuda", max_candidates=5)
    assert len(small) == 5 and small[0] == base
    odd = BlockConfig({"BLOCK_N": 64}, 16, 7)  # launch options outside the searched axes
    assert tune_mod.config_space("score_stacked", odd, "cuda")[0] == odd


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
    won = tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256)
    assert won == cfgs[1]
    choice = get_config("score_stacked", "sm90", "bf16", 200, table_dir=tmp_path)
    assert choice.config == cfgs[1] and choice.tuned
    assert choice.provenance["us"] == 7.5 and choice.provenance["previous_us"] == 10.0
    assert choice.provenance["verdict"] == "faster"


def test_a_win_inside_the_noise_confirms_the_current_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    df, cfgs = _tuned([10.0, 9.9], [0.1, 0.1], noise_rel=0.03)  # 1% faster, 3% repeat noise
    assert tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256) == cfgs[0]
    choice = get_config("score_stacked", "sm90", "bf16", 256, table_dir=tmp_path)
    assert choice.provenance["verdict"] == "confirmed" and choice.provenance["us"] == 10.0
