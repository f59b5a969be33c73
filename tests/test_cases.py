"""Seeded case generator (qsa.cases): determinism, shuffled pages, ragged batches, a poisoned
pool, outlier channels, every format combination, and CaseSpec errors that name the field."""

from __future__ import annotations

import pytest
import torch

from qsa.cases import Case, CaseSpec, make_case
from qsa.formats import dequantize_kv
from qsa.presets import ShapeError, get_preset
from qsa.reference.score import compressed_keys

PRESET = get_preset().replace(block_size=16)
CTX = (37, 100, 5)
ROWS = (2, 4, 1)
FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaN-poisoned tensors compare bit for bit."""
    return t.contiguous().view(torch.uint8)


def case_tensors(c: Case) -> dict[str, torch.Tensor]:
    out = {f"cache.{k}": v for k, v in c.cache.items()}
    out.update({"block_table": c.batch.block_table, "context_lens": c.batch.context_lens,
                "query_start": c.batch.query_start, "positions": c.batch.positions,
                "q": c.q, "q_index": c.q_index, "rms_weight": c.rms_weight,
                "raw_keys": c.raw_keys, "k_new": c.k_new, "v_new": c.v_new})
    return out


def written_slots(c: Case) -> torch.Tensor:
    """Token slots of every position < ctx of every request, from the table by hand."""
    bs, table = c.batch.block_size, c.batch.block_table.tolist()
    return torch.tensor([table[r][p // bs] * bs + p % bs
                         for r, ctx in enumerate(c.spec.context_lens) for p in range(ctx)])


def written_groups(c: Case) -> torch.Tensor:
    """Compressed slots (block * B/4 + offset) of every complete group."""
    bs, table = c.batch.block_size, c.batch.block_table.tolist()
    return torch.tensor([table[r][4 * g // bs] * (bs // 4) + (4 * g % bs) // 4
                         for r, ctx in enumerate(c.spec.context_lens) for g in range(ctx // 4)],
                        dtype=torch.long)


def mask_of(idx: torch.Tensor, n: int) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    m[idx] = True
    return m


def is_nan(t: torch.Tensor) -> torch.Tensor:
    return t.float().isnan()


# --------------------------------------------------------------------------------------------

def test_same_seed_same_tensors_different_seed_different() -> None:
    spec = CaseSpec(PRESET, CTX, ROWS, index_format="fp8", kv_format="fp8", seed=7)
    a, b = case_tensors(make_case(spec)), case_tensors(make_case(spec))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), k
    other = case_tensors(make_case(CaseSpec(PRESET, CTX, ROWS, index_format="fp8",
                                            kv_format="fp8", seed=8)))
    for k in ("block_table", "q", "q_index", "rms_weight", "raw_keys", "k_new", "v_new",
              "cache.k", "cache.index_raw", "cache.index_compressed"):
        assert not torch.equal(bits(a[k]), bits(other[k])), k


@pytest.mark.parametrize("seed", [0, 1])
def test_page_tables_are_shuffled(seed: int) -> None:
    ctx = (100, 64, 33)
    c = make_case(CaseSpec(PRESET, ctx, (1, 1, 1), seed=seed, build_kv=False))
    pages = [(n + 15) // 16 for n in ctx]
    t = c.batch.block_table.tolist()
    used = [b for r, n in enumerate(pages) for b in t[r][:n]]
    assert used != list(range(len(used))) and used != sorted(used)
    assert len(set(used)) == len(used) and min(used) >= 0 and max(used) < c.num_blocks
    assert all(b == -1 for r, n in enumerate(pages) for b in t[r][n:])
    c.batch.validate(c.num_blocks)
    plain = make_case(CaseSpec(PRESET, ctx, (1, 1, 1), seed=seed, shuffle_pages=False,
                               build_kv=False))
    t = plain.batch.block_table.tolist()
    assert [b for r, n in enumerate(pages) for b in t[r][:n]] == list(range(sum(pages)))


def test_ragged_contexts_and_rows() -> None:
    ctx, rows = (37, 100, 5, 64), (2, 4, 0, 3)
    c = make_case(CaseSpec(PRESET, ctx, rows, seed=3))
    p = PRESET
    assert c.batch.context_lens.tolist() == list(ctx)
    assert c.batch.rows_per_request.tolist() == list(rows)
    assert c.batch.query_start.tolist() == [0, 2, 6, 6, 9]
    want_pos = [n - r + i for n, r in zip(ctx, rows) for i in range(r)]
    assert c.batch.positions.tolist() == want_pos
    n = sum(rows)
    assert c.q.shape == (n, p.num_q_heads, p.head_dim) and c.q.dtype == torch.bfloat16
    assert c.q_index.shape == (n, p.index_heads, p.index_dim)
    assert c.raw_keys.shape == (n, p.index_dim) and c.raw_keys.dtype == torch.bfloat16
    assert c.k_new.shape == c.v_new.shape == (n, p.num_kv_heads, p.head_dim)
    assert c.rms_weight.shape == (p.index_dim,)
    for t in (c.q, c.q_index, c.raw_keys, c.k_new, c.v_new, c.rms_weight):
        assert bool(torch.isfinite(t.float()).all()) and bool((t != 0).any())
    # Index queries are normalized to norm sqrt(D) (spec: "already normalized").
    assert torch.allclose(c.q_index.norm(dim=-1), torch.full((n, p.index_heads),
                                                             p.index_dim ** 0.5), rtol=1e-4)
    # The query rows' tokens are in the cache: their raw keys and K/V are the case's.
    bs, table = p.block_size, c.batch.block_table.tolist()
    rr = c.batch.row_request.tolist()
    for i, (r, pos) in enumerate(zip(rr, want_pos)):
        blk, off = table[r][pos // bs], pos % bs
        assert torch.equal(c.cache["index_raw"][blk, off, 0], c.raw_keys[i])
        assert torch.equal(c.cache["k"][blk, off], c.k_new[i])
        assert torch.equal(c.cache["v"][blk, off], c.v_new[i])


def test_decode_constructor() -> None:
    spec = CaseSpec.decode(PRESET, batch=3, context=50)
    assert spec.context_lens == (50, 50, 50) and spec.rows_per_request == (4, 4, 4)
    assert CaseSpec.decode(PRESET, 2, 9, rows=1).rows_per_request == (1, 1)


@pytest.mark.parametrize("index_format,kv_format,fp8", [
    ("bf16", "bf16", torch.float8_e4m3fn), ("fp8", "fp8", torch.float8_e4m3fn),
    ("mxfp4", "fp8", torch.float8_e4m3fnuz), ("fp8", "bf16", torch.float8_e4m3fnuz)])
def test_pool_poisoned_outside_written_slots(index_format: str, kv_format: str,
                                             fp8: torch.dtype) -> None:
    c = make_case(CaseSpec(PRESET, CTX, ROWS, index_format=index_format, kv_format=kv_format,
                           fp8_dtype=fp8, seed=4, spare_blocks=2))
    bs = PRESET.block_size
    n_tok, n_grp = c.num_blocks * bs, c.num_blocks * bs // 4
    tok = mask_of(written_slots(c), n_tok)
    grp = mask_of(written_groups(c), n_grp)
    assert bool((~tok).any()) and bool((~grp).any())  # there is something unwritten
    for name in ("k", "v", "k_scale", "v_scale", "index_raw"):
        if name not in c.cache:
            continue
        t = is_nan(c.cache[name]).reshape(n_tok, -1)
        assert not bool(t[tok].any()), name
        assert bool(t[~tok].all()), name
    comp = c.cache["index_compressed"]
    scale = c.cache.get("index_compressed_scale")
    if index_format == "mxfp4":
        # Codes are bytes (0xFF is a legal pair of -6 codes); 0xFF is never a written E8M0
        # exponent (e + 127 <= 254), so the exponent plane shows what was written.
        e = scale.reshape(n_grp, -1)
        assert bool((e[grp] != 0xFF).all()) and bool((e[~grp] == 0xFF).all())
        assert bool((comp.reshape(n_grp, -1)[~grp] == 0xFF).all())
    else:
        t = is_nan(comp).reshape(n_grp, -1)
        assert not bool(t[grp].any()) and bool(t[~grp].all())
        if scale is not None:
            s = is_nan(scale).reshape(n_grp, -1)
            assert not bool(s[grp].any()) and bool(s[~grp].all())


def test_build_kv_false_has_no_kv_fields() -> None:
    c = make_case(CaseSpec(PRESET, CTX, ROWS, kv_format="fp8", build_kv=False))
    assert not any(n in c.cache for n in ("k", "v", "k_scale", "v_scale"))
    assert {"index_raw", "index_compressed"} <= set(c.cache)


def _channel_rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(0).sqrt()


@pytest.mark.parametrize("n_out", [0, 4, 7])
def test_outlier_channels(n_out: int) -> None:
    c = make_case(CaseSpec(PRESET, (300, 200), (1, 1), outlier_channels=n_out, seed=5))
    s = written_slots(c)
    bs = PRESET.block_size
    raw = c.cache["index_raw"][s // bs, s % bs, 0]  # [tokens, 128]
    k = c.cache["k"][s // bs, s % bs].reshape(-1, PRESET.head_dim)  # [tokens*Hkv, 256]
    v = c.cache["v"][s // bs, s % bs].reshape(-1, PRESET.head_dim)
    for name, x, ratio in (("index_raw", raw, 12.0), ("k", k, 12.0), ("v", v, 4.0)):
        rms = _channel_rms(x)
        big = rms > 0.5 * ratio * rms.median()
        assert int(big.sum()) == n_out, (name, rms.topk(8).values / rms.median())
        if n_out:  # the outliers really stand out: some channel's RMS >> the median
            assert float(rms.max() / rms.median()) > 0.75 * ratio, name


def _expect_field(spec_kwargs: dict, field: str) -> ValueError:
    kw = dict(preset=PRESET, context_lens=CTX, rows_per_request=ROWS)
    kw.update(spec_kwargs)
    with pytest.raises(ValueError) as info:
        CaseSpec(**kw)
    assert str(info.value).startswith(field), str(info.value)
    return info.value


@pytest.mark.parametrize("kwargs,field", [
    (dict(context_lens=(), rows_per_request=()), "context_lens"),
    (dict(rows_per_request=(1, 1)), "rows_per_request"),
    (dict(context_lens=(37, 0, 5)), "context_lens[1]"),
    (dict(context_lens=(37, 100, PRESET.max_context + 1)), "context_lens[2]"),
    (dict(rows_per_request=(2, 101, 1)), "rows_per_request[1]"),
    (dict(rows_per_request=(-1, 4, 1)), "rows_per_request[0]"),
    (dict(spare_blocks=-1), "spare_blocks"),
])
def test_casespec_errors_name_the_field(kwargs: dict, field: str) -> None:
    assert isinstance(_expect_field(kwargs, field), ShapeError)


@pytest.mark.parametrize("kwargs,words", [
    (dict(index_format="fp16"), "index format"), (dict(kv_format="mxfp4"), "KV format")])
def test_casespec_format_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        CaseSpec(PRESET, CTX, ROWS, **kwargs)
    assert words in str(info.value)


def test_casespec_rejects_non_fp8_dtype() -> None:
    """A non-E4M3 fp8_dtype must be refused when the spec is made, naming the field, not
    later inside make_case with a message about a dtype."""
    _expect_field(dict(kv_format="fp8", fp8_dtype=torch.float16), "fp8_dtype")


def test_casespec_rejects_negative_outlier_channels() -> None:
    """outlier_channels=-1 must not silently mean "all channels but one" (a [:-1] slice)."""
    _expect_field(dict(outlier_channels=-1), "outlier_channels")


# --------------------------------------------------------------------------------------------
# Every index x KV format (x FP8 flavour) builds, with the declared field layout of spec
# section 5, and its values agree with the BF16 case of the same seed.
# --------------------------------------------------------------------------------------------

def _spec_fields(index_format: str, kv_format: str, fp8: torch.dtype, nb: int
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    b, hkv, d, di = PRESET.block_size, PRESET.num_kv_heads, PRESET.head_dim, PRESET.index_dim
    kvd = torch.bfloat16 if kv_format == "bf16" else fp8
    out = {"k": ((nb, b, hkv, d), kvd), "v": ((nb, b, hkv, d), kvd)}
    if kv_format == "fp8":
        out["k_scale"] = out["v_scale"] = ((nb, b, hkv), torch.float32)
    out["index_raw"] = ((nb, b, 1, di), torch.bfloat16)
    if index_format == "bf16":
        out["index_compressed"] = ((nb, b // 4, 1, di), torch.bfloat16)
    elif index_format == "fp8":
        out["index_compressed"] = ((nb, b // 4, 1, di), fp8)
        out["index_compressed_scale"] = ((nb, b // 4, 1), torch.float32)
    else:
        out["index_compressed"] = ((nb, b // 4, 1, di // 2), torch.uint8)
        out["index_compressed_scale"] = ((nb, b // 4, 1, di // 32), torch.uint8)
    return out


@pytest.fixture(scope="module")
def bf16_case() -> Case:
    return make_case(CaseSpec(PRESET, CTX, ROWS, seed=11))


@pytest.mark.parametrize("fp8", FP8, ids=["fn", "fnuz"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
@pytest.mark.parametrize("index_format", ["bf16", "fp8", "mxfp4"])
def test_every_format_combination_builds(index_format: str, kv_format: str, fp8: torch.dtype,
                                         bf16_case: Case) -> None:
    c = make_case(CaseSpec(PRESET, CTX, ROWS, index_format=index_format, kv_format=kv_format,
                           fp8_dtype=fp8, seed=11))
    want = _spec_fields(index_format, kv_format, fp8, c.num_blocks)
    assert list(c.cache) == list(want)  # declared order, nothing missing or extra
    for name, (shape, dtype) in want.items():
        assert (tuple(c.cache[name].shape), c.cache[name].dtype) == (shape, dtype), name
    # Same seed, same inputs: only the storage format differs.
    assert torch.equal(c.batch.block_table, bf16_case.batch.block_table)
    assert torch.equal(c.q, bf16_case.q)
    for r in range(c.batch.batch):
        ref = compressed_keys(bf16_case.cache, bf16_case.batch, r, "bf16")
        got = compressed_keys(c.cache, c.batch, r, index_format)
        amax = ref.abs().amax(-1, keepdim=True)
        tol = {"bf16": 0.0, "fp8": 2 ** -4, "mxfp4": 1 / 3}[index_format] + 2 ** -7
        assert bool(((got - ref).abs() <= tol * amax).all()), (index_format, r)
        if index_format != "bf16":
            assert not torch.equal(got, ref)
    s = written_slots(c)
    bs = PRESET.block_size
    for name in ("k", "v"):
        sc = c.cache.get(f"{name}_scale")
        got = dequantize_kv(c.cache[name][s // bs, s % bs],
                            None if sc is None else sc[s // bs, s % bs], kv_format)
        ref = bf16_case.cache[name][s // bs, s % bs].float()
        amax = ref.abs().amax(-1, keepdim=True)
        tol = 2 ** -4 + 2 ** -7 if kv_format == "fp8" else 0.0
        assert bool(((got - ref).abs() <= tol * amax).all()), name
