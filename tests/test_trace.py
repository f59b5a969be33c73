"""Selection traces (qsa.trace, docs/traces.md): a written trace reads back as it was, every
malformed file is refused with one line naming the file and the problem, `qsa trace synth` and
`qsa trace check` work from the command line, and the workbench replays a trace's selections."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qsa import cases
from qsa import overlap as ov
from qsa.presets import get_preset
from qsa.trace import (FORMAT, VERSION, SelectionTrace, TraceError, describe, read_trace,
                       synth_trace, write_trace)
from qsa.workbench import ops
from support import tiny_preset

REPO = Path(__file__).resolve().parents[1]
PRESET = get_preset()
TINY = tiny_preset()  # named like the default preset, with top-8 groups and QSA layers 3, 7


def hand_trace(layers: tuple[int, ...] = (3,), q_index: bool = True) -> SelectionTrace:
    """Two requests: 4 rows at context 20 (4 or 5 visible groups: fewer than the top-8, so
    padded) and 3 rows at context 100 (24-25 visible: 8 selected)."""
    contexts, rows = [20, 100], [4, 3]
    request = torch.tensor([0] * 4 + [1] * 3, dtype=torch.int32)
    position = torch.tensor([16, 17, 18, 19, 97, 98, 99], dtype=torch.int32)
    visible = torch.tensor([4, 4, 4, 5, 24, 24, 25], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    groups = torch.full((len(layers), sum(rows), TINY.topk_groups), -1, dtype=torch.int32)
    for li in range(len(layers)):
        for r, v in enumerate(visible.tolist()):
            n = min(v, TINY.topk_groups)
            groups[li, r, :n] = torch.randperm(v, generator=gen)[:n].sort().values
    extras = {}
    if q_index:
        extras["q_index"] = torch.randn((len(layers), sum(rows), TINY.index_heads,
                                         TINY.index_dim), generator=gen)
    return SelectionTrace(TINY, layers, torch.tensor(contexts, dtype=torch.int32), request,
                          position, visible, groups, extras, source="by hand")


def tensors_of(t: SelectionTrace) -> dict[str, torch.Tensor]:
    return {"context_lens": t.context_lens, "request": t.request, "position": t.position,
            "visible": t.visible, "groups": t.groups, **t.extras}


def meta_of(t: SelectionTrace) -> dict[str, str]:
    return {"format": FORMAT, "version": VERSION, "preset": t.preset.name,
            "topk_groups": str(t.preset.topk_groups), "layers": json.dumps(list(t.layers)),
            "source": t.source}


def save_raw(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """A file in the trace's container, written without the writer's checks."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def refused(path: Path, match: str, preset=TINY) -> str:
    with pytest.raises(TraceError, match=match) as e:
        read_trace(path, preset)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    return msg


def assert_same_trace(a: SelectionTrace, b: SelectionTrace) -> None:
    assert a.preset == b.preset and a.layers == b.layers and a.source == b.source
    for name in ("context_lens", "request", "position", "visible", "groups"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert set(a.extras) == set(b.extras)
    for k in a.extras:
        assert a.extras[k].dtype == b.extras[k].dtype and torch.equal(a.extras[k], b.extras[k])


# ---------------------------------------------------------------------------------------------
# Round trip and the synthetic trace


def test_write_read_round_trip(tmp_path):
    t = hand_trace(layers=(3, 7, 8))  # both QSA layers and the draft layer
    path = write_trace(tmp_path / "t.safetensors", t)
    back = read_trace(path, TINY)
    assert_same_trace(back, t)
    assert back.rows == 7 and back.rows_per_request == (4, 3)
    assert back.layer_at(None) == 0 and back.layer_at(8) == 2
    with pytest.raises(TraceError, match=r"no layer 5; it holds layers \[3, 7, 8\]"):
        back.layer_at(5)
    # without the optional queries, too
    bare = hand_trace(q_index=False)
    assert_same_trace(read_trace(write_trace(tmp_path / "b.safetensors", bare), TINY), bare)


def test_token_ids_expand_the_groups_and_the_tail():
    t = hand_trace()
    ids = t.token_ids()
    for r in range(t.rows):
        g = [x for x in t.groups[0, r].tolist() if x >= 0]
        pos = int(t.position[r])
        want = [4 * x + i for x in g for i in range(4)] + list(range(4 * ((pos + 1) // 4),
                                                                     pos + 1))
        row = ids[r].tolist()
        assert row[:len(want)] == want and all(x == -1 for x in row[len(want):])


def test_synth_trace_hits_its_overlap_and_round_trips(tmp_path):
    t = synth_trace(PRESET, 8, 8192, 4, 0.9, layers=2, seed=4)
    assert t.layers == PRESET.qsa_layers[:2] and t.groups.shape == (2, 32, PRESET.topk_groups)
    for layer in t.layers:
        assert abs(t.overlap(layer).jaccard - 0.9) <= 0.03
    d = describe(t)
    assert d["rows"] == 32 and d["requests"] == 8 and d["layers"] == [3, 7]
    assert abs(d["overlap_measured"] - 0.9) <= 0.03 and d["union_rows"] == 4
    assert 1.0 <= d["union_ratio"] < 2.0
    back = read_trace(write_trace(tmp_path / "s.safetensors", t))  # the preset it names
    assert_same_trace(back, t)
    assert describe(back) == d
    # seeded: the same seed, the same selections; layers differ from each other
    again = synth_trace(PRESET, 8, 8192, 4, 0.9, layers=2, seed=4)
    assert torch.equal(again.groups, t.groups) and not torch.equal(t.groups[0], t.groups[1])
    with pytest.raises(TraceError, match=r"layers: 3 is outside 1\.\.2"):
        synth_trace(TINY, 2, 64, 4, 0.5, layers=3)


# ---------------------------------------------------------------------------------------------
# Refusals: the container


def test_not_safetensors_is_refused(tmp_path):
    cases = {
        "empty": (b"", r"0 bytes, not a safetensors file \(truncated\?\)"),
        "short": (b"abc", r"3 bytes, not a safetensors file"),
        "text": (b"this is a text file, not a trace\n",
                 r"header of \d+ bytes in a file of 33: truncated or not a safetensors file"),
        "garbage": ((5).to_bytes(8, "little") + b"\xff\xfe{x}",
                    r"the safetensors header is not JSON"),
        "list": ((2).to_bytes(8, "little") + b"[]", r"the safetensors header is not a JSON object"),
    }
    for name, (data, match) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        refused(path, match)
    refused(tmp_path / "absent.safetensors", r"can not read it")
    refused(tmp_path, r"can not read it")  # a directory


def test_a_truncated_file_is_refused_at_every_length(tmp_path):
    data = write_trace(tmp_path / "whole.safetensors", hand_trace()).read_bytes()
    header = int.from_bytes(data[:8], "little")
    cuts = sorted({0, 1, 7, 8, 9, 8 + header // 2, 8 + header - 1, 8 + header, 8 + header + 1,
                   len(data) // 2, len(data) - 4, len(data) - 1,
                   *range(8 + header, len(data), 97)})
    for n in cuts:
        path = tmp_path / f"cut{n}.safetensors"
        path.write_bytes(data[:n])
        refused(path, r"truncated|not a safetensors file|not a valid safetensors file")


def test_format_version_preset_topk_and_layer_metadata_are_checked(tmp_path):
    t = hand_trace()
    tensors, meta = tensors_of(t), meta_of(t)

    def with_meta(name: str, **changes: str | None) -> Path:
        m = {k: v for k, v in {**meta, **changes}.items() if v is not None}
        return save_raw(tmp_path / f"{name}.safetensors", tensors, m)

    refused(with_meta("noformat", format=None), r"not a selection trace \(metadata format must "
                                                r"be 'qsa-selection-trace'\)")
    refused(with_meta("otherformat", format="qsa-trace"), r"not a selection trace")
    refused(save_raw(tmp_path / "nometa.safetensors", tensors, {}), r"not a selection trace")
    refused(with_meta("v2", version="2"), r"trace version '2'; this reader takes '1'")
    refused(with_meta("nov", version=None), r"trace version None")
    refused(with_meta("nopreset", preset="llama"), r"preset: .*unknown preset 'llama'")
    good = with_meta("good")
    refused(good, r"a trace of preset 'qwen3\.8-flash-next', not 'qwen3\.8-flash-next-tp2'",
            preset="qwen3.8-flash-next-tp2")
    refused(good, r"a trace of preset 'qwen3\.8-flash-next', not 'qwen3\.8-flash-next-tp2'",
            preset=get_preset("qwen3.8-flash-next-tp2"))
    # the preset it names selects top-512: this top-8 trace needs its own preset object
    refused(good, r"selected with top-8 groups; preset 'qwen3\.8-flash-next' selects 512",
            preset=None)
    refused(with_meta("topk", topk_groups="16"), r"selected with top-16 groups; preset "
                                                 r"'qwen3\.8-flash-next' selects 8")
    for i, bad in enumerate(["", "3", "[]", "[3.0]", '["3"]', "{}", "[true]", "[3,"]):
        refused(with_meta(f"layers{i}", layers=bad), r"metadata layers must be a JSON list of "
                                                      r"layer ids")
    refused(with_meta("nolayers", layers=None), r"metadata layers must be a JSON list")
    for i, bad in enumerate([[0], [4], [9], [-1]]):
        refused(with_meta(f"notqsa{i}", layers=json.dumps(bad)),
                re.escape(f"layers {bad}: each once, from the preset's QSA layers [3, 7] or 8 "
                          "(the draft layer)"))
    two = {**tensors, "groups": tensors["groups"].repeat(2, 1, 1),
           "q_index": tensors["q_index"].repeat(2, 1, 1, 1)}
    refused(save_raw(tmp_path / "twice.safetensors", two, {**meta, "layers": "[3, 3]"}),
            r"layers \[3, 3\]: each once")


def test_missing_and_unknown_tensors_are_refused(tmp_path):
    t = hand_trace()
    tensors, meta = tensors_of(t), meta_of(t)
    for name in ("context_lens", "request", "position", "visible", "groups"):
        partial = {k: v for k, v in tensors.items() if k != name}
        refused(save_raw(tmp_path / f"no_{name}.safetensors", partial, meta),
                rf"missing tensors \['{name}'\]")
    refused(save_raw(tmp_path / "unknown.safetensors", {**tensors, "scores": torch.zeros(3),
                                                        "aux": torch.zeros(1)}, meta),
            r"unknown tensors \['aux', 'scores'\]")


# ---------------------------------------------------------------------------------------------
# Refusals: the tensors (each through the reader and the writer)

BAD_TENSORS = {
    "groups int64": (lambda d: d.update(groups=d["groups"].long()),
                     r"groups must be int32, got torch\.int64"),
    "position float": (lambda d: d.update(position=d["position"].float()),
                       r"position must be int32, got torch\.float32"),
    "context_lens 2-d": (lambda d: d.update(context_lens=d["context_lens"][None]),
                         r"context_lens must be \[requests\] with at least one, got \(1, 2\)"),
    "no requests": (lambda d: d.update(context_lens=d["context_lens"][:0]),
                    r"context_lens must be \[requests\] with at least one, got \(0,\)"),
    "request short": (lambda d: d.update(visible=d["visible"][:-1]),
                      r"visible must be \[rows\] = \[7\], got \(6,\)"),
    "no rows": (lambda d: d.update(**{k: d[k][:0] for k in ("request", "position", "visible")},
                                   groups=d["groups"][:, :0], q_index=d["q_index"][:, :0]),
                r"no rows"),
    "groups topk": (lambda d: d.update(groups=torch.cat([d["groups"], d["groups"][..., :1]], -1)),
                    r"groups must be \[layers, rows, topk\] = \[1, 7, 8\], got \[1, 7, 9\]"),
    "groups layers": (lambda d: d.update(groups=d["groups"].repeat(2, 1, 1)),
                      r"groups must be \[layers, rows, topk\] = \[1, 7, 8\], got \[2, 7, 8\]"),
    "context 0": (lambda d: d["context_lens"].__setitem__(0, 0),
                  r"context_lens outside 1\.\.262144"),
    "context too long": (lambda d: d["context_lens"].__setitem__(1, 262145),
                         r"context_lens outside 1\.\.262144"),
    "request out of range": (lambda d: d["request"].__setitem__(6, 2),
                             r"request ids outside 0\.\.1"),
    "request negative": (lambda d: d["request"].__setitem__(0, -1),
                         r"request ids outside 0\.\.1"),
    "request decreasing": (lambda d: d.update(request=torch.tensor([0, 0, 1, 0, 1, 1, 1],
                                                                    dtype=torch.int32)),
                           r"rows are not grouped by request \(request ids must not decrease\)"),
    "position not last": (lambda d: d["position"].__setitem__(0, 15),
                          r"row 0: position 15; a request's rows are its last tokens, so 16 "
                          r"\(context 20\)"),
    "position past the end": (lambda d: d["position"].__setitem__(6, 100),
                              r"row 6: position 100; .* so 99 \(context 100\)"),
    "positions swapped": (lambda d: d.update(position=d["position"][[1, 0, 2, 3, 4, 5, 6]]),
                          r"row 0: position 17; .* so 16"),
    "visible": (lambda d: d["visible"].__setitem__(1, 5),
                r"row 1: visible 5 does not match its position \(expected 4\)"),
    "group beyond visible": (lambda d: d["groups"].__setitem__((0, 0, 3), 4),
                             r"layer 3 row 0: a group id outside -1\.\.3"),
    "group below -1": (lambda d: d["groups"].__setitem__((0, 5, 0), -2),
                       r"layer 3 row 5: a group id outside -1\.\.23"),
    "too few": (lambda d: d["groups"].__setitem__((0, 4, 7), -1),
                r"layer 3 row 4: 7 groups selected, expected min\(top-k, visible\) = 8"),
    "too few of the visible": (lambda d: d["groups"].__setitem__((0, 3, 4), -1),
                               r"layer 3 row 3: 4 groups selected, expected min\(top-k, "
                               r"visible\) = 5"),
    "too many": (lambda d: d["groups"].__setitem__((0, 0, 4), 3),
                 r"layer 3 row 0: 5 groups selected, expected min\(top-k, visible\) = 4"),
    "padding first": (lambda d: d["groups"].__setitem__(
                          (0, 0), torch.tensor([-1, 0, 1, 2, 3, -1, -1, -1])),
                      r"groups: -1 padding must follow the selected groups"),
    "unsorted": (lambda d: d["groups"].__setitem__((0, 4), d["groups"][0, 4].flip(0)),
                 r"groups: each row's groups must be ascending and distinct"),
    "duplicate": (lambda d: d["groups"].__setitem__((0, 5, 1), d["groups"][0, 5, 0]),
                  r"groups: each row's groups must be ascending and distinct"),
    "q_index nan": (lambda d: d["q_index"].__setitem__((0, 2, 1, 5), float("nan")),
                    r"q_index holds non-finite values"),
    "q_index inf": (lambda d: d["q_index"].__setitem__((0, 6, 3, 0), float("-inf")),
                    r"q_index holds non-finite values"),
    "q_index float64": (lambda d: d.update(q_index=d["q_index"].double()),
                        r"q_index must be float32 \[1, 7, 4, 64\], got torch\.float64 "
                        r"\[1, 7, 4, 64\]"),
    "q_index shape": (lambda d: d.update(q_index=d["q_index"][:, :, :2]),
                      r"q_index must be float32 \[1, 7, 4, 64\], got torch\.float32 "
                      r"\[1, 7, 2, 64\]"),
}


@pytest.mark.parametrize("what", sorted(BAD_TENSORS))
def test_malformed_tensors_are_refused_by_reader_and_writer(tmp_path, what):
    damage, match = BAD_TENSORS[what]
    t = hand_trace()
    tensors = {k: v.clone() for k, v in tensors_of(t).items()}
    damage(tensors)
    path = save_raw(tmp_path / "bad.safetensors", tensors, meta_of(t))
    refused(path, match)
    bad = SelectionTrace(TINY, t.layers, *(tensors[k] for k in ("context_lens", "request",
                                                               "position", "visible",
                                                               "groups")),
                         extras={"q_index": tensors["q_index"]})
    out = tmp_path / "written.safetensors"
    with pytest.raises(TraceError, match=match):
        write_trace(out, bad)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# The command line


def _qsa(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m qsa.cli ARGS` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "qsa.cli", *args], capture_output=True,
                          text=True, env=dict(os.environ), timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_cli_synth_then_check(tmp_path):
    path = tmp_path / "t.safetensors"
    res = _qsa(["trace", "synth", str(path), "--overlap", "0.9", "--batch", "4", "--context",
                "4K", "--rows", "4", "--layers", "2", "--seed", "3"])
    assert res.returncode == 0, res.stderr[-2000:]
    written = json.loads(res.stdout)
    assert written["written"] == str(path) and written["rows"] == 16
    assert abs(written["overlap_measured"] - 0.9) <= 0.03
    assert path.is_file()
    res = _qsa(["trace", "check", str(path)])
    assert res.returncode == 0, res.stderr[-2000:]
    checked = json.loads(res.stdout)
    assert checked["overlap_measured"] == pytest.approx(written["overlap_measured"])
    assert checked["overlap_by_layer"] == pytest.approx(written["overlap_by_layer"])
    assert checked["layers"] == [3, 7] and checked["requests"] == 4
    assert "overlap 0.9" in checked["source"] and "seed 3" in checked["source"]


@pytest.mark.slow
def test_cli_check_refuses_a_damaged_file_in_one_line(tmp_path):
    good = write_trace(tmp_path / "good.safetensors", synth_trace(PRESET, 2, 2048, 4, 0.0))
    data = good.read_bytes()
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(data[:len(data) // 2])
    other = tmp_path / "other.safetensors"
    other.write_bytes(data)
    for path, args, what in ((damaged, [], "not a valid safetensors file"),
                             (other, ["--preset", "qwen3.8-flash-next-tp2"],
                              "a trace of preset 'qwen3.8-flash-next', not "
                              "'qwen3.8-flash-next-tp2'")):
        res = _qsa(["trace", "check", str(path), *args])
        assert res.returncode == 2, res.stdout + res.stderr
        assert "Traceback" not in res.stderr + res.stdout and res.stdout == ""
        # besides the error: the hint to rerun with --verbose, and without TRITON_INTERPRET
        # set the note that kernels would run under the interpreter
        lines = [x for x in res.stderr.splitlines() if x.strip()
                 and not x.startswith(("(run with --verbose", "INFO "))]
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith(f"error: {path}: ") and what in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------
# Replay in the workbench


@pytest.fixture
def replayed_ids(monkeypatch) -> list[torch.Tensor]:
    """The token ids each prepared sparse GQA point hands to its K/V pool (and kernel)."""
    seen: list[torch.Tensor] = []
    real = cases.touched_kv_pool

    def spy(batch, ids, *args, **kw):
        seen.append(ids.clone())
        return real(batch, ids, *args, **kw)

    monkeypatch.setattr(cases, "touched_kv_pool", spy)
    return seen


SHAPE = dict(batch=2, context=128, rows=8)  # 16 rows: 14 neighbouring pairs


def test_a_trace_point_replays_the_traces_selections(tmp_path, replayed_ids):
    t = synth_trace(TINY, SHAPE["batch"], SHAPE["context"], SHAPE["rows"], 0.8, layers=2,
                    seed=5)
    path = write_trace(tmp_path / "t.safetensors", t)
    for layer in (None, 7):
        prep = ops.prepare(ops.Point("sparse_gqa_decode", TINY, **SHAPE, selection="trace",
                                     trace=str(path), trace_layer=layer, seed=5), "cpu")
        assert torch.equal(replayed_ids[-1], t.token_ids(layer))
        want = t.overlap(layer, prep.inputs["union_rows"])
        assert prep.inputs["overlap_measured"] == pytest.approx(want.jaccard, abs=1e-12)
        assert prep.inputs["union_ratio"] == pytest.approx(want.union_ratio, abs=1e-12)
    with pytest.raises(ValueError, match="overlap: a trace's selections overlap as they were"):
        ops.Point("sparse_gqa_decode", TINY, **SHAPE, selection="trace", trace=str(path),
                  overlap=0.5)


def test_a_trace_record_has_no_overlap_target(tmp_path):
    """A trace's selections were not made for a target: its rows must not claim one (a suite
    target `where: {overlap_target: 0.0}` would pick them as independent rows)."""
    path = write_trace(tmp_path / "t.safetensors", synth_trace(TINY, 2, 64, 4, 0.5, seed=1))
    point = ops.Point("sparse_gqa_decode", TINY, 2, 64, 4, selection="trace", trace=str(path),
                      seed=1)
    assert point.as_record()["overlap_target"] is None
    rec = ops.measure("sparse_gqa_decode", preset=TINY, batch=2, context=64, rows=4,
                      selection="trace", trace=str(path), seed=1, timed=False, device="cpu")
    assert rec["trace"] == str(path) and rec["overlap_measured"] > 0.4
    assert rec["overlap_target"] is None, rec["overlap_target"]


@pytest.mark.parametrize("op", ["sparse_gqa_decode"])
def test_a_replayed_synthetic_trace_reproduces_the_overlap_run(tmp_path, replayed_ids, op):
    """docs/traces.md: a trace written by `qsa trace synth --overlap J --seed S` holds the same
    selections as `qsa bench --selection random --overlap J` with seed S."""
    seed, target = 5, 0.8
    t = synth_trace(TINY, SHAPE["batch"], SHAPE["context"], SHAPE["rows"], target, seed=seed)
    path = write_trace(tmp_path / "t.safetensors", t)
    replay = ops.measure(op, preset=TINY, **SHAPE, selection="trace", trace=str(path),
                         seed=seed, timed=False, device="cpu")
    run = ops.measure(op, preset=TINY, **SHAPE, selection="random", overlap=target, seed=seed,
                      timed=False, device="cpu")
    assert replay["verified"] and run["verified"]
    trace_ids, random_ids = replayed_ids
    assert torch.equal(trace_ids, random_ids)
    for key in ("overlap_measured", "union_ratio", "union_rows", "path"):
        assert replay[key] == run[key], key
    assert not math.isnan(run["overlap_measured"])


def test_overlap_measure_of_a_trace_is_the_module_measure():
    t = hand_trace()
    o = t.overlap(per=2)
    want = ov.measure(t.token_ids(), t.batch(), 2)
    assert (o.jaccard, o.union_ratio, o.per) == (want.jaccard, want.union_ratio, 2)
    assert t.overlap().per == TINY.rows_per_verify
