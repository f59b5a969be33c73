"""Index-key compress kernel against the float32 reference (spec section 2.2).

Comparison rule (the same on CPU and GPU, except for the interpreter's FP8 cast):
* The kernel and the reference agree up to FP32 noise a few ulp wide (RMS sum order,
  cos/sin implementations, FMA in the rotation). So every stored code must be a correct
  rounding of the reference's FP32 key moved by at most DELTA = 2^-19 x the row's amax; in
  practice that means bit-equal codes except where the reference key sits on a rounding
  boundary, and the tests also bound how often codes differ from the reference's at all.
* FP8 scales: equal to within DELTA relative (amax / fp8_max of keys that agree to DELTA).
  MXFP4 exponents: the exponent of the group amax moved by at most DELTA.
* The quantizers themselves are integer math (MXFP4) or IEEE division plus an RNE cast (FP8),
  and are checked on their own, bit-exactly, on crafted rows (ties, zero groups, subnormals,
  exact powers of two): MXFP4 everywhere, FP8 scales everywhere and FP8 codes on the GPU.
* Under the interpreter the in-kernel fp32 -> fp8 cast is wrong for a few % of values (triton
  #8322): it rounds some ties away from even (one code step off) and drops
  the rounding carry into the exponent (a round-up to a power of two lands on half of it). CPU
  tests accept exactly those two slips, for at most 5% of the codes; GPU tests accept none.
* Slots outside the groups a pass completes must keep their poison, byte for byte.
"""

from __future__ import annotations


import pytest
import torch
import triton
import triton.language as tl

from qsa.cases import CaseSpec, make_case, poison_
from qsa.configs import BlockConfig
from qsa.formats import E2M1_VALUES, E8M0_BIAS, e2m1_decode, e2m1_round, fp8_max, mx_exponent
from qsa.formats import fp8_quantize_rows, mxfp4_quantize
from qsa.kernels.common import KernelInputError
from qsa.kernels.compress import (_fp8_encode, _mxfp4_encode, compress_index_keys, work)
from qsa.paging import PagedBatch
from qsa.presets import get_preset
from qsa.reference.compress import completed_groups, compress_reference, rope_inv_freq
from qsa.tolerances import CODE_MISMATCH, INTERPRETER_FP8_MISMATCH
from support import DEVICE, INTERPRETING, compile_for_gpu_targets, surrogate_cache

FORMATS = ("bf16", "fp8", "mxfp4")
DELTA = 2.0 ** -19

surrogate_mark = pytest.mark.interp_surrogate


def _preset(block_size: int, **kw):
    return get_preset(block_size=block_size, **kw)


def _case(preset, ctx, fmt, seed=0, device=DEVICE):
    return make_case(CaseSpec(preset, ctx, (1,) * len(ctx), index_format=fmt, build_kv=False,
                              seed=seed), device=device)


def _fresh_output(cache: dict[str, torch.Tensor], surrogate: bool = False, pad: int = 0
                  ) -> dict[str, torch.Tensor]:
    """A copy of the cache with the output planes poisoned.

    surrogate: fp32 copies of the bf16 fields (the dtype-generic path; the kernel only loads and
    converts bf16 and stores bf16-exact values, which the interpreter does right, so the other
    CPU tests run the production dtypes). pad: elements between blocks, so the block dim has a
    stride of its own as in the arena (a clone would make it contiguous again).
    """
    out = {}
    for name, t in (surrogate_cache(cache) if surrogate else cache).items():
        per = t[0].numel()
        buf = torch.empty((t.shape[0], per + pad), dtype=t.dtype, device=t.device)
        out[name] = buf[:, :per].view(t.shape)
        out[name].copy_(t)
        if name in ("index_compressed", "index_compressed_scale"):
            poison_(out[name])
    return out


def _slots(batch: PagedBatch, start: torch.Tensor):
    req, grp = completed_groups(batch, start)
    slot = batch.slots(req, grp * 4)
    return slot // batch.block_size, (slot % batch.block_size) // 4


def _assert_untouched(before: torch.Tensor, after: torch.Tensor, blk, off) -> None:
    written = torch.zeros(before.shape[:2], dtype=torch.bool, device=before.device)
    written[blk, off] = True
    b = before.contiguous().view(torch.uint8).reshape(*before.shape[:2], -1)
    a = after.contiguous().view(torch.uint8).reshape(*after.shape[:2], -1)
    assert torch.equal(a[~written], b[~written]), "a slot outside the completed groups changed"


def _q8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(dtype)
    return v.clamp(-m, m).to(dtype).float()


def _q4(v: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 value nearest to v (RNE), saturating at 6: monotone in v."""
    mag = torch.tensor(E2M1_VALUES, device=v.device)[e2m1_round(v.abs().clamp(max=6)).long()]
    return torch.where(v < 0, -mag, mag)


def _interp_fp8_slip(kern: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """Codes the interpreter's fp32 -> fp8 cast gets wrong (triton #8322): one code step off
    (it rounds some ties away from even), or a round-up into the next binade that loses its
    carry and lands on half the power of two."""
    def byte(v: torch.Tensor) -> torch.Tensor:
        return v.to(dtype).view(torch.uint8).int()

    kb = byte(kern)
    step = torch.zeros_like(kb, dtype=torch.bool)
    for r in (lo, hi):
        rb = byte(r)
        step |= ((kb & 0x80) == (rb & 0x80)) & ((kb - rb).abs() == 1)
    twice = kern * 2
    mant, _ = torch.frexp(twice.abs())
    carry = (kern != 0) & ((twice == lo) | (twice == hi)) & (mant == 0.5)
    return step | carry


def assert_compressed_match(fmt: str, kern: dict, ref: dict, keys: torch.Tensor, blk, off,
                            fp8_dtype: torch.dtype) -> None:
    """Check the written slots by the rule of the module docstring."""
    keys = keys.float()
    delta = DELTA * keys.abs().amax(-1, keepdim=True)
    lo_k, hi_k = keys - delta, keys + delta
    kc, rc = kern["index_compressed"][blk, off, 0], ref["index_compressed"][blk, off, 0]
    if fmt == "bf16":
        v = kc.float()
        assert ((v >= lo_k.to(torch.bfloat16).float()) & (v <= hi_k.to(torch.bfloat16).float())
                ).all(), "a BF16 key is not a rounding of the reference key"
        assert (v != rc.float()).float().mean() <= CODE_MISMATCH
        return
    ks, rs = kern["index_compressed_scale"][blk, off], ref["index_compressed_scale"][blk, off]
    if fmt == "fp8":
        ks, rs = ks[..., 0], rs[..., 0]
        assert torch.isfinite(ks).all() and ((ks - rs).abs() <= DELTA * rs).all(), \
            "FP8 row scales differ by more than the FP32 noise"
        v = kc.float()
        lo, hi = _q8(lo_k / ks[:, None], fp8_dtype), _q8(hi_k / ks[:, None], fp8_dtype)
        bad = ~((v >= lo) & (v <= hi))
        if INTERPRETING:
            assert (bad & ~_interp_fp8_slip(v, lo, hi, fp8_dtype)).sum() == 0, \
                "FP8 codes off by more than the interpreter's cast errors"
            assert bad.float().mean() <= INTERPRETER_FP8_MISMATCH
        else:
            assert bad.sum() == 0, "an FP8 code is not a rounding of the reference key"
            assert (v != rc.float()).float().mean() <= CODE_MISMATCH
        return
    # MXFP4
    n, d = keys.shape
    e = ks[:, 0].long()
    gmax = keys.abs().reshape(n, d // 32, 32).amax(-1)
    e_lo = mx_exponent((gmax - delta).clamp(min=0)) + E8M0_BIAS
    e_hi = mx_exponent(gmax + delta) + E8M0_BIAS
    assert ((e >= e_lo) & (e <= e_hi)).all(), "an MXFP4 exponent is not that of the group amax"
    nib = torch.stack((kc & 15, kc >> 4), -1).reshape(n, d)
    assert (nib != 8).all(), "a zero magnitude was stored as -0"
    scale = torch.exp2(e.float() - E8M0_BIAS).repeat_interleave(32, -1)
    v = e2m1_decode(nib)
    assert ((v >= _q4(lo_k / scale)) & (v <= _q4(hi_k / scale))).all(), \
        "an MXFP4 code is not a rounding of the reference key"
    assert (kc != rc).float().mean() <= CODE_MISMATCH
    assert (ks != rs).float().mean() <= CODE_MISMATCH


def _run_and_check(case, start: torch.Tensor, fmt: str, config=None, surrogate: bool = False,
                   pad: int = 0) -> dict:
    p = case.preset
    ref = {k: v.clone() for k, v in case.cache.items()}
    for name in ("index_compressed", "index_compressed_scale"):
        if name in ref:
            poison_(ref[name])
    keys = compress_reference(ref, case.batch, start, case.rms_weight, p, fmt,
                              case.spec.fp8_dtype)
    kern = _fresh_output(case.cache, surrogate, pad)
    before = {k: v.clone() for k, v in kern.items()}
    compress_index_keys(kern, case.batch, start, case.rms_weight,
                        rope_inv_freq(p).to(start.device), p, fmt, config)
    blk, off = _slots(case.batch, start)
    for name in ("index_compressed", "index_compressed_scale"):
        if name in kern:
            _assert_untouched(before[name], kern[name], blk, off)
    assert torch.equal(kern["index_raw"].view(torch.uint8), before["index_raw"].view(torch.uint8))
    if blk.numel():
        assert_compressed_match(fmt, kern, ref, keys, blk, off, case.spec.fp8_dtype)
    return kern


# ------------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_compress_matches_reference(fmt: str, block_size: int) -> None:
    """Ragged contexts (one shorter than a group, one ending mid-group), shuffled pages."""
    p = _preset(block_size)
    case = _case(p, (3, 37, 70, 2 * block_size + 8), fmt, seed=block_size)
    _run_and_check(case, torch.zeros(case.batch.batch, dtype=torch.int32, device=DEVICE), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compress_pass_starting_mid_group(fmt: str) -> None:
    """Only groups start//4 <= g < ctx//4 are written; every other slot keeps its poison."""
    p = _preset(16)
    case = _case(p, (40, 37, 70, 9, 21), fmt, seed=3)
    start = torch.tensor([38, 30, 66, 9, 5], dtype=torch.int32, device=DEVICE)
    _run_and_check(case, start, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_group_straddling_chunks_compresses_like_one_chunk(fmt: str) -> None:
    """Two prefill chunks split inside a group give the same bytes as one pass."""
    p = _preset(16)
    case = _case(p, (45, 30), fmt, seed=5)
    b = case.batch
    zero = torch.zeros(b.batch, dtype=torch.int32, device=DEVICE)
    one_pass = _run_and_check(case, zero, fmt)

    cut = torch.tensor([18, 13], dtype=torch.int32, device=DEVICE)  # inside groups 4 and 3
    first = PagedBatch(b.block_table, cut, torch.zeros(b.batch + 1, dtype=torch.int32,
                                                       device=DEVICE),
                       torch.zeros(0, dtype=torch.int32, device=DEVICE), b.block_size)
    two = _fresh_output(case.cache)
    inv = rope_inv_freq(p).to(DEVICE)
    compress_index_keys(two, first, zero, case.rms_weight, inv, p, fmt)
    compress_index_keys(two, b, cut, case.rms_weight, inv, p, fmt)
    for name in ("index_compressed", "index_compressed_scale"):
        if name in two:
            assert torch.equal(two[name].view(torch.uint8), one_pass[name].view(torch.uint8))


@surrogate_mark
@pytest.mark.parametrize("fmt", FORMATS)
def test_compress_arena_views_and_explicit_config(fmt: str) -> None:
    """Cache fields with a padded block stride (arena views), an explicit config, and on CPU
    the fp32 surrogate of the bf16 fields (the kernel is dtype-generic: bf16 -> fp32)."""
    p = _preset(16)
    case = _case(p, (50, 23), fmt, seed=7)
    padded = _fresh_output(case.cache, pad=40)
    assert all(t.stride(0) == t[0].numel() + 40 for t in padded.values())
    cfg = BlockConfig({"GROUPS": 2, "PROGRAMS": 3}, num_warps=2, num_stages=1)
    _run_and_check(case, torch.zeros(2, dtype=torch.int32, device=DEVICE), fmt, cfg,
                   surrogate=INTERPRETING, pad=40)


# --- the quantizers on their own -----------------------------------------------------------------

@triton.jit
def _mx_probe(x_ptr, codes_ptr, exp_ptr, G: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, G)
    y = tl.load(x_ptr + r[:, None] * D + tl.arange(0, D)[None, :])
    packed, ebyte = _mxfp4_encode(y, G, D)
    tl.store(codes_ptr + r[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :], packed.to(tl.uint8))
    tl.store(exp_ptr + r[:, None] * (D // 32) + tl.arange(0, D // 32)[None, :], ebyte.to(tl.uint8))


@triton.jit
def _fp8_probe(x_ptr, codes_ptr, scale_ptr, G: tl.constexpr, D: tl.constexpr,
               FP8_MAX: tl.constexpr):
    r = tl.arange(0, G)
    off = r[:, None] * D + tl.arange(0, D)[None, :]
    q, s = _fp8_encode(tl.load(x_ptr + off), FP8_MAX)
    tl.store(codes_ptr + off, q.to(codes_ptr.dtype.element_ty))
    tl.store(scale_ptr + r, s)


def _crafted_rows(d: int = 128) -> torch.Tensor:
    """Rows that hit every MXFP4 decision: grid points and midpoints (ties) of E2M1 at many
    exponents (subnormal to huge), amax on and just past 6 * 2^e and 1.5 * 2^E, zero and
    tiny groups, negatives that round to zero, and random outlier rows."""
    pts = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                        0.1, 0.2, 0.3, 2.25, 2.75, 4.5, 5.5, 0.0, 0.26, 0.74, 1.26, 1.74, 2.49,
                        3.51, 4.99, 5.01, 5.99, 0.24])
    base = torch.cat((pts, -pts)).reshape(2, 32)
    rows = []
    for k in (-140, -130, -127, -126, -60, -3, 0, 1, 7, 100):
        rows.append(torch.cat((base[0], base[1], base[1], base[0])) * 2.0 ** k)
    six = torch.zeros(d)
    six[0] = 6.0 * (1 + 2 ** -23)  # just past 6 * 2^0: exponent up
    six[32] = 1.5 * 2 ** 3
    six[33] = 0.75 * 2 ** 2  # a tie at the new scale
    six[64] = 1.5 * 2 ** 3 * (1 + 2 ** -23)
    six[96:] = 2.0 ** -149  # a group of the smallest subnormal
    rows.append(six)
    rows.append(torch.zeros(d))
    neg_small = torch.full((d,), -0.2)
    neg_small[5] = 6.0
    rows.append(neg_small)
    gen = torch.Generator().manual_seed(11)
    for s in (1.0, 1e-3, 1e4):
        r = torch.randn(d, generator=gen) * s
        r[torch.randperm(d, generator=gen)[:4]] *= 12
        rows.append(r)
    out = torch.stack(rows).float()
    assert out.shape[0] == 16
    return out


def test_mxfp4_quantizer_bit_exact() -> None:
    x = _crafted_rows().to(DEVICE)
    codes = torch.empty((16, 64), dtype=torch.uint8, device=DEVICE)
    exps = torch.empty((16, 4), dtype=torch.uint8, device=DEVICE)
    _mx_probe[(1,)](x, codes, exps, G=16, D=128)
    rc, re = mxfp4_quantize(x.cpu())
    assert torch.equal(exps.cpu(), re)
    assert torch.equal(codes.cpu(), rc)


def test_fp8_quantizer() -> None:
    dtype = torch.float8_e4m3fn
    x = _crafted_rows().to(DEVICE)
    x[1] = 2.0 ** -149  # scale underflows to 0: scale 1, zero codes
    codes = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    scale = torch.empty(16, dtype=torch.float32, device=DEVICE)
    _fp8_probe[(1,)](x, codes, scale, G=16, D=128, FP8_MAX=fp8_max(dtype))
    rc, rs = fp8_quantize_rows(x.cpu(), dtype)
    assert torch.equal(scale.cpu(), rs)
    v, r = codes.cpu().float(), rc.float()
    if INTERPRETING:
        bad = v != r
        assert (bad & ~_interp_fp8_slip(v, r, r, dtype)).sum() == 0
        assert bad.float().mean() <= INTERPRETER_FP8_MISMATCH
    else:
        assert torch.equal(v, r)


# --- errors -------------------------------------------------------------------------------------

def _err_case(fmt: str = "fp8"):
    p = _preset(16)
    case = _case(p, (20, 9), fmt, seed=2)
    cache = _fresh_output(case.cache)
    start = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    return p, case, cache, start, rope_inv_freq(p).to(DEVICE)


def test_errors() -> None:
    p, case, cache, start, inv = _err_case()
    b, w = case.batch, case.rms_weight

    def call(c=cache, batch=b, s=start, weight=w, f=inv, fmt="fp8", preset=p):
        compress_index_keys(c, batch, s, weight, f, preset, fmt)

    cases = {
        "format": lambda: call(fmt="fp4"),
        "missing scale": lambda: call(c={k: v for k, v in cache.items()
                                         if k != "index_compressed_scale"}),
        "format/dtype": lambda: call(fmt="mxfp4"),
        "raw dtype": lambda: call(c={**cache, "index_raw": cache["index_raw"].half()}),
        "raw inner layout": lambda: call(c={**cache, "index_raw": torch.repeat_interleave(
            cache["index_raw"], 2, dim=-1)[..., ::2]}),
        "scale dtype": lambda: call(c={**cache, "index_compressed_scale":
                                       cache["index_compressed_scale"].double()}),
        "preset dims": lambda: call(preset=p.replace(index_dim=64)),
        "start dtype": lambda: call(s=start.long()),
        "start shape": lambda: call(s=start[:1]),
        "weight shape": lambda: call(weight=w[:64]),
        "inv_freq dtype": lambda: call(f=inv.double()),
        "negative start": lambda: call(s=torch.tensor([-4, 0], dtype=torch.int32,
                                                       device=DEVICE)),
        "page past pool": lambda: call(batch=PagedBatch(
            torch.where(b.block_table >= 0, b.block_table + 1000, b.block_table),
            b.context_lens, b.query_start, b.positions, b.block_size)),
        "block size": lambda: call(preset=p.replace(block_size=32)),
    }
    for what, fn in cases.items():
        with pytest.raises(KernelInputError):
            fn()
            pytest.fail(f"no error for {what}")


@pytest.mark.slow
def test_compress_compiles_for_gpu_targets() -> None:
    variants = []
    for fmt, code, scale in (("bf16", "*bf16", "constexpr"), ("fp8", "*fp8e4nv", "*fp32"),
                             ("mxfp4", "*u8", "*u8")):
        sig = {"raw_ptr": "*bf16", "raw_s0": "i64", "out_ptr": code, "out_s0": "i64",
               "scale_ptr": scale, "scale_s0": "i32", "bt_ptr": "*i32", "bt_s0": "i32",
               "max_pages": "i32", "ctx_ptr": "*i32", "start_ptr": "*i32", "weight_ptr": "*fp32",
               "inv_freq_ptr": "*fp32", "batch": "i32", "num_blocks": "i32", "eps": "fp32"}
        consts = {"D": 128, "ROPE_HALF": 32, "PAGE": 64, "BLOCK_B": 64, "FMT": fmt,
                  "FP8_MAX": 448.0, "GROUPS": 4, "PROGRAMS": 528}
        if fmt == "bf16":
            consts["scale_ptr"] = None
        sig.update({k: "constexpr" for k in consts})
        variants.append((sig, consts, {"num_warps": 4}))
    compile_for_gpu_targets("qsa.kernels.compress", "_compress_kernel", variants)


def test_work_counts_bytes() -> None:
    p = get_preset()
    assert work(p, "bf16", 10).bytes_moved == 10 * (1024 + 256 + 4)
    assert work(p, "mxfp4", 1).bytes_moved == 1024 + 64 + 4 + 4
    assert work(p, "fp8", 0).bytes_moved == 0


# ------------------------------------------------------------------------------------------------
# GPU tests: larger shapes, real bf16, exact FP8 casts
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_compress_large(fmt: str, block_size: int) -> None:
    p = _preset(block_size)
    case = _case(p, (16384 + 3, 4097, 2, 1000, 8190), fmt, seed=21, device="cuda")
    start = torch.tensor([0, 2000, 0, 998, 8185], dtype=torch.int32, device="cuda")
    _run_and_check(case, start, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_compress_decode_batch(fmt: str) -> None:
    """A 4-row verify at batch 64: one or two completed groups per request."""
    p = _preset(64)
    ctx = tuple(2048 + 37 * i for i in range(64))
    case = _case(p, ctx, fmt, seed=22, device="cuda")
    start = case.batch.context_lens - 4
    _run_and_check(case, start, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_straddling_chunks(fmt: str) -> None:
    p = _preset(64)
    case = _case(p, (5000, 777), fmt, seed=23, device="cuda")
    b = case.batch
    zero = torch.zeros(2, dtype=torch.int32, device="cuda")
    one_pass = _run_and_check(case, zero, fmt)
    cut = torch.tensor([2049, 390], dtype=torch.int32, device="cuda")
    first = PagedBatch(b.block_table, cut, torch.zeros(3, dtype=torch.int32, device="cuda"),
                       torch.zeros(0, dtype=torch.int32, device="cuda"), b.block_size)
    two = _fresh_output(case.cache)
    inv = rope_inv_freq(p).cuda()
    compress_index_keys(two, first, zero, case.rms_weight, inv, p, fmt)
    compress_index_keys(two, b, cut, case.rms_weight, inv, p, fmt)
    for name in ("index_compressed", "index_compressed_scale"):
        if name in two:
            assert torch.equal(two[name].view(torch.uint8), one_pass[name].view(torch.uint8))
