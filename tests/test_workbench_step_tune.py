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
    assert all("waves_per_eu" in c.amd for c in hip)
    assert {c.meta["BLOCK_N"] for c in cuda} == {32, 64, 128}
    assert {c.meta["SPLIT"] for c in cuda} == {1}
    assert len(tune_mod.config_space("score_stacked", base, "cuda", max_candidates=5)) == 5


def test_tune_records_failures_and_refuses_interpreter_winners(monkeypatch, tmp_path):
    real = tune_mod.measure_prepared
    calls = []

    def flaky(prep, cfg, samples=None):
        calls.append(cfg)
        if len(calls) == 2:
            raise RuntimeError("out of resources: shared memory")
        return real(prep, cfg, samples=1)

    monkeypatch.setattr(tune_mod, "measure_prepared", flaky)
    df = tune_mod.tune("score_rowwise", preset=TINY, batch=1, context=24, rows=1,
                       max_candidates=3, progress=False)
    assert list(df["status"]) == ["ok", "RuntimeError", "ok"]
    assert "shared memory" in df["error"].iloc[1]
    with pytest.raises(RuntimeError, match="interpreter"):
        tune_mod.write_winner(df, "score_rowwise", "default", "bf16", 1)


def test_write_winner_stores_provenance(monkeypatch, tmp_path):
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tmp_path))
    cfgs = [BlockConfig({"BLOCK_N": 64}, 4, 2), BlockConfig({"BLOCK_N": 128}, 8, 3)]
    df = pd.DataFrame({"status": ["ok", "ok"], "is_current": [True, False],
                       "us": [10.0, 7.5], "p10_us": [9.8, 7.4], "p90_us": [10.3, 7.7],
                       "method": ["graph_replay"] * 2, "functional_only": [False, False],
                       "config": [json.dumps(c.as_dict()) for c in cfgs]})
    won = tune_mod.write_winner(df, "score_stacked", "sm90", "bf16", 256)
    assert won == cfgs[1]
    choice = get_config("score_stacked", "sm90", "bf16", 200, table_dir=tmp_path)
    assert choice.config == cfgs[1] and choice.tuned
    assert choice.provenance["us"] == 7.5 and choice.provenance["previous_us"] == 10.0
