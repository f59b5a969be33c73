"""The measurement path: every op verifies against the reference before it is timed, and a
wrong kernel output is refused, never timed."""

import json
import os

import pytest
import torch

from qsa.workbench import ops, verify
from qsa.workbench.ops import Point, VerificationError, measure, prepare
from qsa.workbench.registry import OPS
from support import tiny_preset

TINY = tiny_preset()


@pytest.mark.parametrize("op", OPS)
def test_every_op_verifies_and_records(op):
    fmt = {"kv_store": ("bf16", "fp8"), "sparse_gqa_decode": ("fp8", "fp8")}.get(op, ("mxfp4", "bf16"))
    rec = measure(op, preset=TINY, batch=2, context=45, rows=2, index_format=fmt[0],
                  kv_format=fmt[1], samples=1)
    assert rec["verified"] is True
    assert rec["op"] == op and rec["batch"] == 2 and rec["context"] == 45
    assert rec["bytes_moved"] > 0 and rec["us"] > 0
    assert rec["impl"] == "triton"  # no other implementation runs without an sm90 GPU
    if not torch.cuda.is_available():
        assert rec["functional_only"] is True and rec["pct_bandwidth"] is None
    json.loads(rec["config"])


def test_the_record_names_the_implementation_the_lookup_resolved():
    """A call whose entry names the Gluon kernel is recorded as such; lookups of other tables
    (the step's other kernels, a merge) do not count."""
    from qsa.configs import BlockConfig
    from qsa.kernels.common import Lookup

    prep = prepare(Point("sparse_gqa_decode", TINY, 1, 45, 1, kv_format="fp8",
                         selection="random"), "cpu")
    gluon = BlockConfig({"BLOCK_N": 64}, impl="gluon")
    seen = [Lookup("sparse_gqa_decode", "fp8", 4, gluon, False),
            Lookup("topk", "fp32", 4, BlockConfig({"CHUNK": 256}), False)]
    assert ops._implementation(prep, seen) == "gluon"
    assert ops._implementation(prep, seen[1:]) == "triton"


def test_wrong_output_is_refused_not_timed(monkeypatch):
    from qsa.kernels import score_stacked as mod

    real = mod.score_stacked

    def broken(*args, **kw):
        out = real(*args, **kw)
        out[0, 0] += 1.0  # one wrong score
        return out

    monkeypatch.setattr(mod, "score_stacked", broken)
    timed = []
    monkeypatch.setattr(ops, "time_fn", lambda *a, **k: timed.append(1))
    with pytest.raises(VerificationError, match="score_stacked"):
        measure("score_stacked", preset=TINY, batch=2, context=45, rows=2)
    assert not timed


def test_unwritten_output_is_refused(monkeypatch):
    from qsa.kernels import score_rowwise as mod

    monkeypatch.setattr(mod, "score_rowwise", lambda *a, out, **k: out)  # writes nothing
    with pytest.raises(VerificationError, match="unwritten"):
        prepare(Point("score_rowwise", TINY, 1, 30, 1)).check(None)


def test_env_overrides_are_restored(monkeypatch):
    monkeypatch.delenv("QSA_STACKED_DECODE_SCORER", raising=False)
    with ops.env_overrides({"QSA_STACKED_DECODE_SCORER": "0"}):
        assert os.environ["QSA_STACKED_DECODE_SCORER"] == "0"
    assert "QSA_STACKED_DECODE_SCORER" not in os.environ


def test_point_rejects_bad_shapes():
    with pytest.raises(ValueError, match="op:"):
        Point("nope", TINY, 1, 8, 1)
    with pytest.raises(ValueError, match="rows:"):
        Point("score_stacked", TINY, 1, 3, 4)
    with pytest.raises(ValueError, match="batch:"):
        Point("score_stacked", TINY, 0, 8, 1)


def test_same_values_is_by_value_chunked_and_on_the_tensors_device(monkeypatch):
    """-0 equals +0 and NaN poison equals NaN poison; any other difference, in any chunk, is a
    mismatch; integers compare exactly; an fp32 surrogate compares as the stored dtype."""
    monkeypatch.setattr(verify, "SAME_VALUES_CHUNK", 5)  # several chunks, the last one short
    want = torch.tensor([0.0, 1.5, float("nan"), -2.0, float("inf"), 3.0, 4.0, 5.0, 6.0, 7.0,
                         8.0, 9.0], dtype=torch.bfloat16).reshape(3, 4)
    got = want.clone()
    got[0, 0] = -0.0
    assert verify.same_values(got, want)
    for i in (1, 6, 11):  # a change in the first, a middle and the last (short) chunk
        bad = got.clone().reshape(-1)
        bad[i] = bad[i] + 1
        assert not verify.same_values(bad.reshape(3, 4), want)
    unpoisoned = got.clone()
    unpoisoned[0, 2] = 0.0
    assert not verify.same_values(unpoisoned, want)
    assert verify.same_values(want.float(), want)  # the interpreter's fp32 surrogate
    assert not verify.same_values(want.float() + 2.0**-12, want.float())
    assert not verify.same_values(want[:2], want)
    ints = torch.arange(12, dtype=torch.int32)
    assert verify.same_values(ints.clone(), ints)
    assert not verify.same_values(ints.flip(0), ints)


def test_topk_points_name_the_table_key_of_their_row_count():
    """Tuning and the compile check address top-k's entries by the key the call reads: the
    decode key below MANY_ROWS rows, the many-rows key from there; the compile check runs
    both keys' entries at any point."""
    from qsa.kernels.topk import FORMAT, FORMAT_MANY_ROWS, MANY_ROWS

    few = Point("topk_expand", TINY, MANY_ROWS // 4 - 1, 4096, 4)
    many = Point("topk_expand", TINY, MANY_ROWS // 4, 4096, 4)
    assert (few.fmt, many.fmt) == (FORMAT, FORMAT_MANY_ROWS)
    assert few.table_formats == many.table_formats == (FORMAT, FORMAT_MANY_ROWS)
    assert Point("score_stacked", TINY, 1, 64, 1, index_format="fp8").table_formats == ("fp8",)


def test_points_held_together_share_one_rotation_budget():
    """A step holds every call's input sets at once: each point takes at most an even share of
    what the points before it left, and one that needs few copies leaves its share to the next.
    Without a budget a point rotates up to the per-point cap."""
    import dataclasses

    from qsa.measure.device import cpu_device
    from qsa.measure.work import Work

    gpu = dataclasses.replace(cpu_device(), vendor="nvidia", llc_bytes=50 << 20)
    big = {"k": torch.empty(1 << 20, dtype=torch.uint8)}  # 1 MiB a set
    cold = Work(bytes_moved=2 << 20, flops=0)  # wants 3 x 50 / 2 + 1 sets
    assert len(verify.rotation_sets(big, cold, gpu)) == 76
    with verify.held_together(3, free_bytes=16 << 20, fraction=0.5) as budget:  # 8 MiB
        small = verify.rotation_sets(big, Work(bytes_moved=200 << 20, flops=0), gpu)
        assert len(small) == 1 and budget.bytes_left == 7 << 20  # one set: no copy needed
        assert len(verify.rotation_sets(big, cold, gpu)) == 3  # 7 MiB over two points
        assert len(verify.rotation_sets(big, cold, gpu)) == 4  # what is left, all of it
        assert budget.bytes_left == 0 and budget.points_left == 0
        assert len(verify.rotation_sets(big, cold, gpu)) == 1  # nothing left: the base alone
    assert verify._BUDGET.get() is None
    with pytest.raises(ValueError, match="fraction"):
        with verify.held_together(2, free_bytes=1 << 20, fraction=1.5):
            pass
