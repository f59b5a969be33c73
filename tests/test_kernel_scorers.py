"""Index scorers (row-wise, stacked decode, prefill) against the float32 reference.

CPU runs use the interpreter surrogate (bf16 tensors handed to the kernels as fp32 copies): they
check paging, masking, decoding, tiling and control flow. Where the math is exact (dyadic inputs:
every product and partial sum representable) the kernels must equal the reference bit for bit,
ties and ReLU zeros included. GPU tests repeat the checks at larger shapes with real bf16 and
compare the row-wise and stacked kernels, scores and top-k selections.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qsa.cases import CaseSpec, make_case
from qsa.configs import BlockConfig, get_config
from qsa.kernels import scoring
from qsa.kernels.common import KernelInputError
from qsa.kernels.index_tiles import HOST_META_KEYS, split_config
from qsa.kernels.score_prefill import _score_prefill_kernel, rows_per_tile, score_prefill
from qsa.kernels.score_rowwise import score_rowwise
from qsa.kernels.score_stacked import _score_stacked_kernel, score_stacked
from qsa.presets import get_preset
from qsa.reference.score import score_reference, visible_groups
from qsa.reference.topk import select_reference
from support import DEVICE, INTERPRETING, poisoned, replay_captured, surrogate

FORMATS = ("bf16", "fp8", "mxfp4")
KERNELS = {"rowwise": score_rowwise, "stacked": score_stacked, "prefill": score_prefill}
NINF = float("-inf")

# Small tiles so that CPU cases span several tiles, tiles per program and key chunks.
SMALL = {
    "rowwise": BlockConfig({"BLOCK_N": 16, "CK": 32, "PROGRAMS_PER_UNIT": 4, "MAX_TILES": 2}),
    "stacked": BlockConfig({"BLOCK_N": 16, "PROGRAMS_PER_UNIT": 4, "MAX_TILES": 2,
                            "HOIST_Q_MIN_TILES": 4}),
    "prefill": BlockConfig({"BLOCK_MH": 64, "BLOCK_N": 16, "PROGRAMS_PER_UNIT": 2,
                            "MAX_TILES": 2}),
}


def index_cache(cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fields a scorer reads, as the kernels are handed them (surrogate on CPU)."""
    return {k: surrogate(v) for k, v in cache.items() if k.startswith("index_compressed")}


def run(kernel: str, case, fmt: str, *, config=None, q=None, weights=None, preset=None):
    """(kernel scores, reference scores); the kernel writes into a poisoned output."""
    p = preset or case.preset
    q = case.q_index.to(torch.bfloat16) if q is None else q
    width = case.batch.max_context // 4
    out = poisoned((case.batch.num_rows, width), torch.float32)
    got = KERNELS[kernel](index_cache(case.cache), case.batch, surrogate(q), p, fmt,
                          head_weights=weights, out=out, config=config)
    assert got is out
    ref = score_reference(case.cache, case.batch, q.float(), p, fmt, head_weights=weights)
    return got, ref


def assert_scores(got: torch.Tensor, ref: torch.Tensor, *, exact: bool = False,
                  rtol: float = 2e-5) -> None:
    assert got.shape == ref.shape
    assert not torch.isnan(got).any(), "an output element was not written (poison survived)"
    assert torch.equal(got == NINF, ref == NINF), "-inf pattern differs from the reference"
    if exact:
        assert torch.equal(got, ref)
        return
    fin = ref != NINF
    scale = ref[fin].abs().max() if fin.any() else torch.tensor(1.0)
    torch.testing.assert_close(got[fin], ref[fin], rtol=rtol, atol=rtol * float(scale))
    # ReLU zeros (ties at 0) stay exact zeros: a zero needs every head's dot <= 0, and these
    # small cases have no head dot within rounding of 0.
    assert torch.equal(got[fin] == 0, ref[fin] == 0)


def ragged_case(fmt: str, block_size: int, *, heads: int = 4, seed: int = 0):
    """Ragged contexts (one shorter than a group) and rows per request 1, 4, 8, 2."""
    p = get_preset().replace(block_size=block_size, index_heads=heads)
    ctx = (3, 37, 70, 130) if block_size == 16 else (3, 61, 130, 203)
    return make_case(CaseSpec(p, ctx, (1, 4, 8, 2), index_format=fmt, build_kv=False,
                              seed=seed), DEVICE)


# ------------------------------------------------------------------------------------------------
# Against the reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.interp_surrogate
@pytest.mark.parametrize("block_size", (16, 64))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kernel", tuple(KERNELS))
def test_scorer_matches_reference(kernel, fmt, block_size):
    case = ragged_case(fmt, block_size)
    got, ref = run(kernel, case, fmt, config=SMALL[kernel] if block_size == 16 else None)
    assert_scores(got, ref)
    assert (ref[0] == NINF).all()  # the request shorter than one group sees nothing


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("heads", (1, 8))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kernel", tuple(KERNELS))
def test_index_heads(kernel, fmt, heads):
    case = ragged_case(fmt, 16, heads=heads, seed=heads)
    got, ref = run(kernel, case, fmt, config=SMALL[kernel])
    assert_scores(got, ref)


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("dim", (64, 256))
@pytest.mark.parametrize("kernel", tuple(KERNELS))
def test_index_dims(kernel, dim):
    """Other index dims: 2 and 8 MXFP4 scale blocks, FP8 rows of 64 and 256 codes."""
    p = get_preset().replace(block_size=16, index_dim=dim, rope_dims=32)
    for fmt in ("mxfp4", "fp8"):
        case = make_case(CaseSpec(p, (21, 66), (2, 3), index_format=fmt, build_kv=False,
                                  seed=dim), DEVICE)
        got, ref = run(kernel, case, fmt, config=SMALL[kernel])
        assert_scores(got, ref)


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("rows", (1, 4, 8))
@pytest.mark.parametrize("kernel", ("rowwise", "stacked"))
def test_uniform_decode_rows(kernel, rows):
    """Decode/verify batches: every request has `rows` rows (1 draft row, 4 verify rows, 8)."""
    fmt = FORMATS[rows % 3]
    p = get_preset().replace(block_size=16)
    case = make_case(CaseSpec.decode(p, 3, 90, rows, index_format=fmt, build_kv=False, seed=rows),
                     DEVICE)
    got, ref = run(kernel, case, fmt, config=SMALL[kernel])
    assert_scores(got, ref)


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kernel", tuple(KERNELS))
def test_signed_head_weights(kernel, fmt):
    """Weights multiply each head after its ReLU: signed weights must not be folded into q."""
    case = ragged_case(fmt, 16, seed=7)
    w = torch.tensor([1.5, -0.5, 2.0, 0.25], device=DEVICE)
    got, ref = run(kernel, case, fmt, config=SMALL[kernel], weights=w)
    assert_scores(got, ref)


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("hoist_min_tiles", (1, 1 << 30))
@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_q_hoisted_or_in_loop(fmt, hoist_min_tiles):
    """Both places of the q load (once per program, or once per tile) give the reference."""
    case = ragged_case(fmt, 16, seed=13)
    config = SMALL["stacked"].with_meta(HOIST_Q_MIN_TILES=hoist_min_tiles)
    got, ref = run("stacked", case, fmt, config=config)
    assert_scores(got, ref)


def dyadic_case(fmt: str):
    """A ragged case whose keys, key scales and queries are small dyadic numbers, so every
    product and partial sum is exact in fp32: scores must equal the reference bit for bit,
    including the many exact zeros of the ReLU and exact ties between groups."""
    case = ragged_case(fmt, 16, seed=11)
    gen = torch.Generator().manual_seed(5)
    c = case.cache
    keys = c["index_compressed"]
    if fmt == "bf16":
        ints = torch.randint(-4, 5, keys.shape, generator=gen).to(keys.device, keys.dtype)
        c["index_compressed"] = torch.where(torch.isnan(keys), keys, ints)
    elif fmt == "fp8":
        written = ~torch.isnan(keys.float())
        ints = torch.randint(-8, 9, keys.shape, generator=gen).to(keys.device).float()
        c["index_compressed"] = torch.where(written, ints, keys.float()).to(keys.dtype)
        pow2 = torch.exp2(torch.randint(-2, 3, c["index_compressed_scale"].shape,
                                        generator=gen).float()).to(keys.device)
        c["index_compressed_scale"] = torch.where(torch.isnan(c["index_compressed_scale"]),
                                                  c["index_compressed_scale"], pow2)
    # MXFP4 keys are already dyadic (E2M1 values times powers of two).
    # Exact ties: two groups of the longest request get identical keys.
    b = case.batch
    dev = b.block_table.device
    slot = b.slots(torch.tensor([3, 3], device=dev), torch.tensor([4, 40], device=dev))
    blk, off = slot // b.block_size, (slot % b.block_size) // 4
    for name in ("index_compressed", "index_compressed_scale"):
        if name in c:
            c[name][blk[1], off[1]] = c[name][blk[0], off[0]]
    q = torch.randint(-8, 9, case.q_index.shape, generator=gen).float() / 4
    return case, q.to(DEVICE, torch.bfloat16)


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kernel", tuple(KERNELS))
def test_exact_math_and_ties(kernel, fmt):
    case, q = dyadic_case(fmt)
    got, ref = run(kernel, case, fmt, config=SMALL[kernel], q=q)
    assert_scores(got, ref, exact=True)
    assert (ref[ref != NINF] == 0).any(), "the case should exercise ReLU zeros"
    r = int(case.batch.query_start[3])  # a row of the longest request sees groups 1 and 10
    assert ref[r, 1] == ref[r, 10] and got[r, 1] == got[r, 10]


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_row_tiles(fmt):
    """A prefill chunk spanning several row tiles (16 rows each at 4 heads), causal per row, and
    key chunks past a tile's horizon (another request's longer context sets the width)."""
    p = get_preset().replace(block_size=16)
    case = make_case(CaseSpec(p, (200, 420, 9), (40, 3, 5), index_format=fmt, build_kv=False,
                              seed=3), DEVICE)
    assert rows_per_tile(SMALL["prefill"].meta["BLOCK_MH"], p.index_heads, p.index_dim) == 16
    got, ref = run("prefill", case, fmt, config=SMALL["prefill"])
    assert_scores(got, ref)
    vis = visible_groups(case.batch)
    assert len(set(vis[:40].tolist())) > 5  # the chunk's rows really see different prefixes


@pytest.fixture
def small_bf16_prefill_tiles(tmp_path, monkeypatch):
    """Tables whose BF16 prefill entries have the small test tiles: a decoded launch takes the
    BF16 entry's tiles whatever config the call passes, and CPU cases should span several."""
    import json
    import shutil

    from qsa.configs import TABLE_DIR

    tables = tmp_path / "tables"
    shutil.copytree(TABLE_DIR, tables)
    path = tables / "score_prefill.json"
    table = json.loads(path.read_text())
    small = SMALL["prefill"]
    for arch in table.values():
        arch["bf16"] = {"4096": {"meta": small.meta, "num_warps": small.num_warps,
                                 "num_stages": small.num_stages}}
    path.write_text(json.dumps(table))
    monkeypatch.setenv("QSA_CONFIG_DIR", str(tables))


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("block_size", (16, 64))
@pytest.mark.parametrize("fmt", ("fp8", "mxfp4"))
def test_prefill_decode_once_matches_the_tile_decode(fmt, block_size, monkeypatch,
                                                     small_bf16_prefill_tiles):
    """FP8/MXFP4 keys decoded once into a scratch (DECODE_MIN_GROUPS) score as the in-kernel
    tile decode does, bit for bit (both decode exactly into the dot's dtype), on ragged
    requests behind shuffled page tables, several row tiles and key chunks past a tile's
    horizon. The decoded launch takes the BF16 table entry's tiles although the call passes
    its own config. The scorer reads a decoded FP8 scratch's scales unmasked: they must run
    on, as scale 1, past the last request's row over every column its tiles cover."""
    from qsa.kernels import score_prefill as pre

    looked_up = []
    real_lookup = pre.lookup
    monkeypatch.setattr(pre, "lookup", lambda kernel, fmt_, size, config: looked_up.append(
        (fmt_, config)) or real_lookup(kernel, fmt_, size, config))
    p = get_preset().replace(block_size=block_size)
    case = make_case(CaseSpec(p, (200, 420, 9), (40, 3, 5), index_format=fmt, build_kv=False,
                              seed=5 + block_size), DEVICE)
    once = BlockConfig({**SMALL["prefill"].meta, "DECODE_MIN_GROUPS": 1})
    decoded = []
    real = pre.decoded_keys
    monkeypatch.setattr(pre, "decoded_keys",
                        lambda inp, span, pdl: decoded.append((span, real(inp, span, pdl))) or
                        decoded[-1][1])
    got, ref = run("prefill", case, fmt, config=once)
    assert looked_up == [(fmt, once), ("bf16", None)]
    assert_scores(got, ref)
    in_tile, _ = run("prefill", case, fmt, config=SMALL["prefill"])
    assert torch.equal(got, in_tile)
    (span, inp), = decoded
    if fmt == "fp8":
        width_p = inp.dense_blocks * inp.gpb
        assert span > width_p, "the case should have tiles reaching past the scratch's rows"
        flat = torch.tensor([], dtype=torch.float32, device=inp.scales.device).set_(
            inp.scales.untyped_storage())
        last = (inp.batch.batch - 1) * width_p
        assert flat.numel() == last + span
        assert (flat[inp.scales.numel():] == 1).all()


def test_prefill_decode_once_threshold_and_override(monkeypatch, small_bf16_prefill_tiles):
    """Decoded once from DECODE_MIN_GROUPS groups of the widest request on; the environment
    forces either way (not for an explicit config); BF16 keys are never decoded."""
    from qsa.kernels import score_prefill as pre

    calls = []
    real = pre.decoded_keys
    monkeypatch.setattr(pre, "decoded_keys",
                        lambda inp, span, pdl: calls.append(inp.width) or real(inp, span, pdl))
    case = ragged_case("fp8", 16, seed=4)
    width = case.batch.max_context // 4
    at = BlockConfig({**SMALL["prefill"].meta, "DECODE_MIN_GROUPS": width})
    above = BlockConfig({**SMALL["prefill"].meta, "DECODE_MIN_GROUPS": 2 * width})
    monkeypatch.setenv(pre.DECODE_ENV, "0")  # not for explicit configs
    on, ref = run("prefill", case, "fp8", config=at)
    off, _ = run("prefill", case, "fp8", config=above)
    assert calls == [width] and torch.equal(on, off)
    assert_scores(on, ref)
    run("prefill", case, "fp8")  # the table's entry, forced off
    monkeypatch.setenv(pre.DECODE_ENV, "1")
    forced, _ = run("prefill", case, "fp8")
    run("prefill", ragged_case("bf16", 16, seed=4), "bf16")
    assert calls == [width, width]
    assert_scores(forced, ref)


def test_prefill_decode_pass_is_a_dependent_launch_only_where_the_device_takes_it(monkeypatch):
    """The scorer follows the decode pass as a programmatic dependent launch on NVIDIA sm90+
    only: never under the interpreter (grids run one after another), on older NVIDIA GPUs, on
    ROCm, or with a Triton build that lacks the NVIDIA device calls."""
    from qsa.kernels import common

    monkeypatch.setattr(common, "gdc_wait", lambda: None)  # as in an NVIDIA build
    for target, expected in ((("cuda", "sm90"), True), (("cuda", "sm100"), True),
                             (("cuda", "sm80"), False), (("hip", "gfx950"), False),
                             (("interpreter", "default"), False)):
        monkeypatch.setattr(common, "backend_and_arch", lambda t=target: t)
        assert common.dependent_launch_here() is expected, target
    monkeypatch.setattr(common, "gdc_wait", None)
    monkeypatch.setattr(common, "backend_and_arch", lambda: ("cuda", "sm90"))
    assert not common.dependent_launch_here()


def test_default_configs_and_strided_blocks():
    """Table defaults, and a cache whose block dim is not packed (an arena view)."""
    fmt = "fp8"
    case = ragged_case(fmt, 16, seed=2)
    for name in ("index_compressed", "index_compressed_scale"):
        t = case.cache[name]
        inner = t[0].numel()
        big = torch.full((t.shape[0], inner + 40), float("nan"), device=t.device).to(t.dtype)
        view = big.as_strided(t.shape, (inner + 40, *t.stride()[1:]))
        view.copy_(t)
        case.cache[name] = view
    for kernel in KERNELS:
        got, ref = run(kernel, case, fmt)
        assert_scores(got, ref)


def test_all_contexts_shorter_than_a_group():
    p = get_preset().replace(block_size=16)
    case = make_case(CaseSpec(p, (3, 2), (2, 1), build_kv=False), DEVICE)
    for kernel in KERNELS:
        got, ref = run(kernel, case, "bf16")
        assert got.shape == ref.shape == (3, 0)


# ------------------------------------------------------------------------------------------------
# Dispatcher, configs, names, work
# ------------------------------------------------------------------------------------------------

def test_dispatcher_env_switch(monkeypatch):
    case = ragged_case("bf16", 16)
    calls = []
    for name in ("score_stacked", "score_rowwise"):
        real = getattr(scoring, name)
        monkeypatch.setattr(scoring, name,
                            lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    args = (index_cache(case.cache), case.batch, surrogate(case.q_index.to(torch.bfloat16)),
            case.preset, "bf16")
    monkeypatch.delenv(scoring.STACKED_ENV, raising=False)
    a = scoring.score_decode(*args)
    monkeypatch.setenv(scoring.STACKED_ENV, "0")
    b = scoring.score_decode(*args)
    monkeypatch.setenv(scoring.STACKED_ENV, "1")
    scoring.score_decode(*args, max_rows_per_request=8)
    assert calls == ["score_stacked", "score_rowwise", "score_stacked"]
    torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ("score_rowwise", "score_stacked", "score_prefill"))
def test_config_tables(kernel):
    for arch in ("default", "sm90", "gfx950"):
        for fmt in FORMATS:
            choice = get_config(kernel, arch, fmt, 4096)
            assert choice.arch == arch
            # A tuned entry says where and how it was measured.
            assert not choice.tuned or {"device", "us", "method"} <= set(choice.provenance)
            assert bool(choice.config.amd) == (arch == "gfx950")
            kw, host = split_config(choice.config, choice.config.launch_kwargs("cuda"))
            assert not set(kw) & set(HOST_META_KEYS) and "waves_per_eu" not in kw
            assert {"PROGRAMS_PER_UNIT", "MAX_TILES"} <= set(host)


def test_kernel_names_carry_config():
    consts = {"FMT": "mxfp4", "H": 4, "D": 128, "GPB": 16, "BLOCK_R": 4, "BLOCK_M": 64,
              "BLOCK_N": 64, "TILES": 8, "WARPS": 4, "STAGES": 2, "HOIST_Q": True}
    spec = SimpleNamespace(constants=consts)

    def name(kernel) -> str:  # the interpreter wraps the JITFunction and keeps its kwargs
        return kernel.kwargs["repr"](spec) if hasattr(kernel, "kwargs") else kernel.repr(spec)

    assert name(_score_stacked_kernel) == (
        "qsa_score_stacked_FMTmxfp4_H4_D128_GPB16_BLOCK_R4_BLOCK_N64_TILES8_WARPS4_STAGES2"
        "_HOIST_QTrue")
    assert name(_score_prefill_kernel).startswith("qsa_score_prefill_FMTmxfp4_H4_D128")


def test_work_counts():
    from qsa.kernels import score_prefill as pre, score_rowwise as rw, score_stacked as st

    p = get_preset().replace(block_size=16)
    case = make_case(CaseSpec(p, (40, 9), (2, 1), index_format="fp8", build_kv=False), DEVICE)
    # rows at positions 38, 39 (request 0) and 8 (request 1): visible 9, 10 and 2 groups
    flops = (9 + 10 + 2) * 2 * 4 * 128
    q_out_meta = 3 * 4 * 128 * 2 + 3 * 10 * 4 + 3 * 4 + 2 * 12
    stacked = st.work(case.batch, p, "fp8")
    assert stacked.flops == flops
    assert stacked.bytes_moved == (10 + 2) * 132 + q_out_meta + (3 + 1) * 4
    rowwise = rw.work(case.batch, p, "fp8")
    assert rowwise.bytes_moved == (9 + 10 + 2) * 132 + q_out_meta + (3 + 3 + 1) * 4
    assert pre.work(case.batch, p, "fp8") == stacked


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def _args(fmt="bf16"):
    case = ragged_case(fmt, 16)
    return case, index_cache(case.cache), surrogate(case.q_index.to(torch.bfloat16))


@pytest.mark.parametrize("kernel", tuple(KERNELS))
def test_input_errors(kernel):
    fn = KERNELS[kernel]
    case, cache, q = _args("fp8")
    p, b = case.preset, case.batch
    with pytest.raises(KernelInputError, match="index format"):
        fn(cache, b, q, p, "int4")
    with pytest.raises(KernelInputError, match="index_compressed: dtype"):
        fn(cache, b, q, p, "bf16")  # FP8 codes read as BF16 keys
    with pytest.raises(KernelInputError, match="index_compressed_scale"):
        fn({"index_compressed": cache["index_compressed"]}, b, q, p, "fp8")
    with pytest.raises(KernelInputError, match="q_index: dtype"):
        fn(cache, b, q.half(), p, "fp8")
    with pytest.raises(KernelInputError, match="q_index: shape"):
        fn(cache, b, q[:, :2], p, "fp8")
    with pytest.raises(KernelInputError, match="q_index: inner dims"):
        fn(cache, b, q.transpose(1, 2).contiguous().transpose(1, 2), p, "fp8")
    keys = cache["index_compressed"]
    bad = dict(cache, index_compressed=keys.transpose(1, 3).contiguous().transpose(1, 3))
    with pytest.raises(KernelInputError, match="index_compressed: inner dims"):
        fn(bad, b, q, p, "fp8")
    with pytest.raises(KernelInputError, match="out: width"):
        fn(cache, b, q, p, "fp8", out=torch.empty(b.num_rows, 3, device=DEVICE))
    with pytest.raises(KernelInputError, match="out: dtype"):
        fn(cache, b, q, p, "fp8", out=torch.empty(b.num_rows, b.max_context // 4,
                                                  device=DEVICE, dtype=torch.float64))
    with pytest.raises(KernelInputError, match="head_weights"):
        fn(cache, b, q, p, "fp8", head_weights=torch.ones(3, device=DEVICE))
    table = b.block_table.clone()
    table[2, 0] = keys.shape[0] + 5
    past = type(b)(table, b.context_lens, b.query_start, b.positions, b.block_size)
    with pytest.raises(KernelInputError, match="outside the pool"):
        fn(cache, past, q, p, "fp8")
    with pytest.raises(KernelInputError, match="block_size"):
        fn(cache, b, q, p.replace(block_size=32), "fp8")
    with pytest.raises(KernelInputError, match="BLOCK_N 8 must be >= 16"):
        fn(cache, b, q, p, "fp8", config=SMALL[kernel].with_meta(BLOCK_N=8))
    with pytest.raises(KernelInputError, match="power of two"):
        fn(cache, b, q, p, "fp8", config=SMALL[kernel].with_meta(MAX_TILES=3))
    if kernel == "stacked":
        meta = {k: v for k, v in SMALL[kernel].meta.items() if k != "HOIST_Q_MIN_TILES"}
        with pytest.raises(KernelInputError, match="HOIST_Q_MIN_TILES"):
            fn(cache, b, q, p, "fp8", config=BlockConfig(meta))


@pytest.mark.parametrize("kernel", ("rowwise", "stacked"))
def test_mxfp4_scales_must_be_word_aligned(kernel):
    """The E8M0 rows are read as 32-bit words: a plane view off a 4-byte boundary is refused
    with the reason, not read misaligned."""
    case = ragged_case("mxfp4", 16)
    cache = index_cache(case.cache)
    s = cache["index_compressed_scale"]
    inner = s[0].numel()
    for pad, stride in ((1, inner), (0, inner + 2)):
        big = torch.zeros(pad + s.shape[0] * stride, dtype=s.dtype, device=s.device)
        view = big[pad:].as_strided(s.shape, (stride, *s.stride()[1:]))
        view.copy_(s)
        with pytest.raises(KernelInputError, match="4-byte aligned"):
            KERNELS[kernel](dict(cache, index_compressed_scale=view), case.batch,
                            surrogate(case.q_index.to(torch.bfloat16)), case.preset, "mxfp4")


def test_validation_is_cached_but_sees_in_place_changes():
    """A batch is validated once for all the layers that score it; changing one of its tensors
    in place validates it again."""
    case, cache, q = _args("bf16")
    b = case.batch
    score_stacked(cache, b, q, case.preset, "bf16")
    score_stacked(cache, b, q, case.preset, "bf16")
    b.block_table[2, 0] = cache["index_compressed"].shape[0] + 5
    with pytest.raises(KernelInputError, match="outside the pool"):
        score_stacked(cache, b, q, case.preset, "bf16")


def test_stacked_row_limits():
    p = get_preset().replace(block_size=16)
    case = make_case(CaseSpec.decode(p, 33, 16, 8, build_kv=False), DEVICE)  # 264 rows
    q = surrogate(case.q_index.to(torch.bfloat16))
    with pytest.raises(KernelInputError, match="at most 256"):
        score_stacked(index_cache(case.cache), case.batch, q, p, "bf16")
    case = make_case(CaseSpec(p, (40, 16), (9, 1), build_kv=False), DEVICE)
    q = surrogate(case.q_index.to(torch.bfloat16))
    with pytest.raises(KernelInputError, match="at most 8"):
        score_stacked(index_cache(case.cache), case.batch, q, p, "bf16")
    with pytest.raises(KernelInputError, match="more than the hint"):
        score_stacked(index_cache(case.cache), case.batch, q, p, "bf16", max_rows_per_request=4)


# ------------------------------------------------------------------------------------------------
# GPU: real bf16 at larger shapes
# ------------------------------------------------------------------------------------------------

def gpu_case(fmt: str, contexts, rows, seed=0):
    p = get_preset()
    return make_case(CaseSpec(p, tuple(contexts), tuple(rows), index_format=fmt, build_kv=False,
                              seed=seed), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kernel", tuple(KERNELS))
def test_gpu_matches_reference(kernel, fmt):
    case = gpu_case(fmt, (3, 4093, 17_000, 40_001, 9_000, 130_000), (1, 4, 8, 4, 2, 4), seed=1)
    got, ref = run(kernel, case, fmt)
    assert_scores_gpu(got, ref)


def assert_scores_gpu(got, ref):
    """Real bf16/fp16 operands: products are exact, only the fp32 summation order differs."""
    assert not torch.isnan(got).any()
    assert torch.equal(got == NINF, ref == NINF)
    fin = ref != NINF
    scale = float(ref[fin].abs().max())
    torch.testing.assert_close(got[fin], ref[fin], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_prefill_chunk(fmt):
    """2K rows of one request (the last 2K tokens of 24K) plus a short request."""
    case = gpu_case(fmt, (24_576, 700), (2048, 64), seed=2)
    got, ref = run("prefill", case, fmt)
    assert_scores_gpu(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ("fp8", "mxfp4"))
def test_gpu_prefill_decode_once(fmt, monkeypatch):
    """Keys decoded once into a bf16 scratch, against the reference and the in-kernel decode,
    at the tables' tile sizes (real bf16 MMAs). Where the scorer is a dependent launch of the
    decode pass (sm90+), it scores bit for bit as when launched after it."""
    from qsa.kernels import score_prefill as pre

    case = gpu_case(fmt, (24_576, 700), (2048, 64), seed=4)
    base = get_config("score_prefill", "default", "bf16", 4096).config
    once = None
    for first in (1, 1 << 20):  # decoded once; decoded in the tiles
        cfg = BlockConfig({**base.meta, "DECODE_MIN_GROUPS": first}, base.num_warps,
                          base.num_stages)
        got, ref = run("prefill", case, fmt, config=cfg)
        assert_scores_gpu(got, ref)
        once = got if once is None else once
    monkeypatch.setattr(pre, "DECODE_PDL", False)
    plain, _ = run("prefill", case, fmt, config=BlockConfig(
        {**base.meta, "DECODE_MIN_GROUPS": 1}, base.num_warps, base.num_stages))
    assert torch.equal(plain, once)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_rowwise_vs_stacked(fmt):
    """Equal within accumulation rounding, and the same top-k groups except between scores
    closer than that rounding."""
    case = gpu_case(fmt, (32_768,) * 12 + (4_000, 70_000, 129, 65_536), (4,) * 16, seed=3)
    rw, _ = run("rowwise", case, fmt)
    st, _ = run("stacked", case, fmt)
    assert torch.equal(rw == NINF, st == NINF)
    fin = rw != NINF
    tol = 1e-5 * float(rw[fin].abs().max())
    torch.testing.assert_close(st[fin], rw[fin], rtol=1e-4, atol=tol)
    vis = visible_groups(case.batch)
    k = case.preset.topk_groups
    g_rw, n = select_reference(rw, vis, k)
    g_st, _ = select_reference(st, vis, k)
    for r in range(rw.shape[0]):
        a = set(g_rw[r, :n[r]].tolist())
        b = set(g_st[r, :n[r]].tolist())
        if a == b:
            continue
        kth = rw[r, g_rw[r, :n[r]].long()].min()
        diff = torch.tensor(sorted(a ^ b), device=rw.device)
        assert (rw[r, diff] - kth).abs().max() <= 4 * tol, f"row {r}: selections differ"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_stacked_large_batch(fmt):
    """A batch large enough that programs score many tiles and load q once (HOIST_Q)."""
    case = gpu_case(fmt, (32_768,) * 40 + (1_000, 65_536), (4,) * 41 + (1,), seed=5)
    got, ref = run("stacked", case, fmt)
    assert_scores_gpu(got, ref)


@pytest.mark.gpu
def test_gpu_stacked_graph_capture():
    """A captured call (out and the row bound passed, data checks skipped) replays exactly."""
    case = gpu_case("mxfp4", (8_192,) * 8, (4,) * 8, seed=4)
    cache, q = index_cache(case.cache), case.q_index.to(torch.bfloat16)
    out = torch.empty(case.batch.num_rows, 2048, device="cuda")
    eager = score_stacked(cache, case.batch, q, case.preset, "mxfp4").clone()
    replay_captured(lambda: score_stacked(cache, case.batch, q, case.preset, "mxfp4", out=out,
                                          max_rows_per_request=4), out)
    assert torch.equal(out, eager)


def test_interpreter_surrogate_is_active():
    """The CPU tests above only mean something under the interpreter surrogate."""
    if DEVICE == "cpu":
        assert INTERPRETING
