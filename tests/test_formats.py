"""Numeric formats (spec section 4): FP8 E4M3 (fn and fnuz) per-row and MXFP4.

Expected values are derived here from the bit layouts (sign / exponent / mantissa fields), never
copied from the implementation: decoding is checked code by code against the formula, rounding
at every midpoint against the even-mantissa rule, and the MXFP4 exponent against an exact search
for the smallest non-clipping power of two.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa import formats
from qsa.formats import FormatError

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
FP8_IDS = ["e4m3fn", "e4m3fnuz"]


# --------------------------------------------------------------------------------------------
# Independent decoders, from the bit fields
# --------------------------------------------------------------------------------------------

def fp8_formula(byte: int, dtype: torch.dtype) -> float | None:
    """Value of an E4M3 byte, None for NaN. fn: bias 7, NaN = S.1111.111, has -0.
    fnuz: bias 8, the only NaN is 0x80 (the would-be -0), no infinities in either."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if dtype == torch.float8_e4m3fn:
        bias = 7
        if e == 15 and m == 7:
            return None
    else:
        bias = 8
        if byte == 0x80:
            return None
    v = (m / 8) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias)
    return -v if s else v


def fp8_half_ulp(y: float, dtype: torch.dtype) -> float:
    """Half the spacing of the E4M3 grid at magnitude |y| (3 mantissa bits; the subnormal range
    has the spacing of the smallest normal binade)."""
    bias = 7 if dtype == torch.float8_e4m3fn else 8
    min_normal_exp = 1 - bias
    a = abs(y)
    exp = min_normal_exp if a < 2.0 ** min_normal_exp else math.floor(math.log2(a))
    return 2.0 ** (exp - 3) / 2


def e2m1_formula(nib: int) -> float:
    """Value of a 4-bit E2M1 code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    s, e, m = nib >> 3, (nib >> 1) & 3, nib & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


E2M1_POS = [(e2m1_formula(n), n) for n in range(8)]  # (magnitude, code), ascending


def e2m1_code(v: float) -> int:
    """Code of an exact grid value (+0 for zero)."""
    for mag, n in E2M1_POS:
        if mag == abs(v):
            return n | (8 if v < 0 and mag > 0 else 0)
    raise AssertionError(f"{v} is not on the E2M1 grid")


def smallest_mx_exponent(amax: float) -> int:
    """Smallest e >= -127 with amax <= 6 * 2^e, by exact search (ldexp is exact)."""
    e = -127
    while amax > math.ldexp(6.0, e):
        e += 1
    return e


def fp8_max_formula(dtype: torch.dtype) -> float:
    return max(v for b in range(256) if (v := fp8_formula(b, dtype)) is not None)


# --------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------

def test_fp8_max_fn_448_fnuz_240() -> None:
    assert formats.fp8_max(torch.float8_e4m3fn) == 448.0 == fp8_max_formula(torch.float8_e4m3fn)
    assert formats.fp8_max(torch.float8_e4m3fnuz) == 240.0 == fp8_max_formula(
        torch.float8_e4m3fnuz)
    with pytest.raises(FormatError):
        formats.fp8_max(torch.bfloat16)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_fp8_max_sets_scale(dtype: torch.dtype) -> None:
    x = torch.tensor([[1000.0, -3.0, 0.5], [-7.0, 1.0, 2.0]])
    codes, scale = formats.fp8_quantize_rows(x, dtype)
    fmax = fp8_max_formula(dtype)
    assert torch.allclose(scale.double(), torch.tensor([1000.0 / fmax, 7.0 / fmax],
                                                       dtype=torch.float64), rtol=1e-6)
    # The amax element uses the top of the range: dynamic scales never saturate, never waste it.
    assert codes.float()[0, 0] == fmax and codes.float()[1, 0] == -fmax


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0])
def test_every_fp8_code_decodes(dtype: torch.dtype, scale: float) -> None:
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    got = formats.fp8_dequantize_rows(raw.view(dtype), torch.full((16,), scale))
    for b in range(256):
        want = fp8_formula(b, dtype)
        g = float(got.flatten()[b])
        if want is None:
            assert math.isnan(g), b
        else:
            assert g == want * scale, (b, g, want)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_every_fp8_value_encodes_to_its_code(dtype: torch.dtype) -> None:
    """Each finite grid value, in a row whose amax pins scale = 1, encodes to exactly its code
    (compared by value, so -0 and +0 are the same code)."""
    fmax = fp8_max_formula(dtype)
    vals = [(b, v) for b in range(256) if (v := fp8_formula(b, dtype)) is not None]
    x = torch.tensor([[fmax, v] for _, v in vals], dtype=torch.float32)
    codes, scale = formats.fp8_quantize_rows(x, dtype)
    assert bool((scale == 1).all())
    got = codes[:, 1].view(torch.uint8).tolist()
    for (b, v), g in zip(vals, got):
        assert fp8_formula(g, dtype) == v, (b, g)


def _fp8_grid(dtype: torch.dtype) -> list[tuple[float, int]]:
    """Non-negative finite grid values with their codes, ascending."""
    return sorted((v, b) for b in range(128) if (v := fp8_formula(b, dtype)) is not None)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_fp8_round_half_even_at_every_midpoint(dtype: torch.dtype) -> None:
    grid = _fp8_grid(dtype)
    fmax = grid[-1][0]
    rows, want = [], []
    for (lo, blo), (hi, bhi) in zip(grid, grid[1:]):
        mid = (lo + hi) / 2  # exact in fp32: one more mantissa bit than E4M3
        assert float(torch.tensor(mid, dtype=torch.float32)) == mid
        even = lo if blo % 2 == 0 else hi  # adjacent codes: exactly one has mantissa lsb 0
        assert (blo % 2 == 0) != (bhi % 2 == 0)
        below = float(torch.nextafter(torch.tensor(mid), torch.tensor(-1.0)))
        above = float(torch.nextafter(torch.tensor(mid), torch.tensor(1e9)))
        for x, w in ((mid, even), (-mid, -even), (below, lo), (above, hi), (-above, -hi)):
            rows.append([fmax, x])
            want.append(w)
    codes, scale = formats.fp8_quantize_rows(torch.tensor(rows), dtype)
    assert bool((scale == 1).all())
    got = codes[:, 1].float()
    assert got.tolist() == want


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_fp8_zero_and_underflowing_rows(dtype: torch.dtype) -> None:
    x = torch.zeros(4, 32)
    x[1] = torch.linspace(-3, 5, 32)
    x[2] = -0.0
    x[3, 7] = 1e-45  # smallest subnormal: amax / fp8_max underflows to 0 in FP32
    codes, scale = formats.fp8_quantize_rows(x, dtype)
    for r in (0, 2, 3):
        assert float(scale[r]) == 1.0
        assert bool((codes[r].float() == 0).all())
    assert float(scale[1]) == pytest.approx(5.0 / fp8_max_formula(dtype), rel=1e-6)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fp8_non_finite_raises(dtype: torch.dtype, bad: float) -> None:
    x = torch.randn(3, 16)
    x[1, 5] = bad
    with pytest.raises(FormatError):
        formats.fp8_quantize_rows(x, dtype)
    with pytest.raises(FormatError):
        formats.quantize_kv(x, "fp8", dtype)
    with pytest.raises(FormatError):
        formats.quantize_index(x, "fp8", dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_bf16_paths_refuse_non_finite(bad: float) -> None:
    x = torch.randn(2, 32)
    x[0, 3] = bad
    with pytest.raises(FormatError):
        formats.quantize_kv(x, "bf16", torch.float8_e4m3fn)
    with pytest.raises(FormatError):
        formats.quantize_index(x, "bf16", torch.float8_e4m3fn)


@st.composite
def rows(draw: st.DrawFn, n_min: int = 1, n_max: int = 64) -> torch.Tensor:
    """Float32 rows with a random overall magnitude, optional outliers and exact zeros."""
    n = draw(st.integers(n_min, n_max))
    vals = draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=n, max_size=n))
    x = torch.tensor(vals, dtype=torch.float32)
    mag = 2.0 ** draw(st.integers(-100, 100))
    if draw(st.booleans()) and n > 1:
        x[draw(st.integers(0, n - 1))] *= draw(st.sampled_from([16.0, 100.0, -37.0]))
    return (x * mag).reshape(1, n)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@settings(max_examples=60, deadline=None)
@given(x=rows())
def test_fp8_round_trip_error_bound(dtype: torch.dtype, x: torch.Tensor) -> None:
    codes, scale = formats.fp8_quantize_rows(x, dtype)
    dq = formats.fp8_dequantize_rows(codes, scale)
    s = float(scale[0])
    fmax = fp8_max_formula(dtype)
    assert bool((codes.float().abs() <= fmax).all())
    for xi, di in zip(x[0].tolist(), dq[0].tolist()):
        y = xi / s
        # half-ulp at |x/scale| (subnormal spacing below the smallest normal), plus the FP32
        # rounding of the division and of code * scale.
        bound = s * fp8_half_ulp(y, dtype) * (1 + 2 ** -20) + abs(xi) * 2 ** -22
        assert abs(xi - di) <= bound, (xi, di, s, bound)


# --------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------

def test_e2m1_grid_matches_spec() -> None:
    assert [m for m, _ in E2M1_POS] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_every_e2m1_code_decodes() -> None:
    got = formats.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == [e2m1_formula(n) for n in range(16)]


@pytest.mark.parametrize("exp_byte", [0, 1, 100, 125, 127, 128, 140, 200, 252])
def test_every_e2m1_code_through_mxfp4_dequantize(exp_byte: int) -> None:
    """All 16 nibbles in both nibble positions, decoded under one E8M0 exponent."""
    nib = torch.arange(32) % 16
    # Element 2i is the low nibble: pair (nib[2i], nib[2i+1]).
    packed = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8).reshape(1, 16)
    got = formats.mxfp4_dequantize(packed, torch.tensor([[exp_byte]], dtype=torch.uint8))
    scale = 2.0 ** (exp_byte - 127)
    want = [e2m1_formula(int(n)) * scale for n in nib]
    assert got[0].double().tolist() == want


def test_e2m1_round_half_even_at_every_midpoint() -> None:
    """A group whose amax is 6 pins e = 0, so x / 2^e is x itself."""
    xs, want = [], []
    for (lo, nlo), (hi, nhi) in zip(E2M1_POS, E2M1_POS[1:]):
        mid = (lo + hi) / 2
        even = lo if nlo % 2 == 0 else hi
        assert (nlo % 2 == 0) != (nhi % 2 == 0)
        for x, w in ((mid, even), (-mid, -even), (mid - 2 ** -10, lo), (mid + 2 ** -10, hi)):
            xs.append(x)
            want.append(w)
    groups = []
    for i in range(0, len(xs), 31):
        chunk = xs[i:i + 31]
        groups.append([6.0] + chunk + [0.0] * (31 - len(chunk)))
    x = torch.tensor(groups, dtype=torch.float32)
    codes, exps = formats.mxfp4_quantize(x)
    assert bool((exps == 127).all())
    dq = formats.mxfp4_dequantize(codes, exps)
    got = [float(dq[i // 31, 1 + i % 31]) for i in range(len(xs))]
    assert got == want
    # Zero magnitudes are stored as +0 (code 0), so codes are a function of the value alone.
    nibs = torch.stack((codes & 15, codes >> 4), -1).reshape(x.shape)
    assert bool((nibs[x.abs() <= 0.25] == 0).all())


def test_packing_order_low_nibble_first() -> None:
    gen = torch.Generator().manual_seed(3)
    grid = [m for m, _ in E2M1_POS] + [-m for m, _ in E2M1_POS[1:]]
    idx = torch.randint(0, len(grid), (2, 64), generator=gen)
    x = torch.tensor([[grid[i] for i in row] for row in idx.tolist()], dtype=torch.float32)
    x[:, 0], x[:, 32] = 6.0, -6.0  # both groups of both rows: e = 0
    codes, exps = formats.mxfp4_quantize(x)
    assert codes.shape == (2, 32) and exps.shape == (2, 2) and codes.dtype == torch.uint8
    assert bool((exps == 127).all())
    for r in range(2):
        for i in range(32):
            want = e2m1_code(float(x[r, 2 * i])) | (e2m1_code(float(x[r, 2 * i + 1])) << 4)
            assert int(codes[r, i]) == want, (r, i)


def test_mxfp4_zero_group() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 128, generator=gen)
    x[0, 32:64] = 0.0
    x[1, 96:128] = -0.0
    codes, exps = formats.mxfp4_quantize(x)
    assert int(exps[0, 1]) == 0 and int(exps[1, 3]) == 0
    assert bool((codes[0, 16:32] == 0).all()) and bool((codes[1, 48:64] == 0).all())
    others = torch.ones_like(exps, dtype=torch.bool)
    others[0, 1] = others[1, 3] = False
    assert bool((exps[others] > 0).all())
    dq = formats.mxfp4_dequantize(codes, exps)
    assert bool((dq[0, 32:64] == 0).all()) and bool((dq[1, 96:128] == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_mxfp4_non_finite_raises(bad: float) -> None:
    x = torch.randn(2, 64)
    x[1, 40] = bad
    with pytest.raises(FormatError):
        formats.mxfp4_quantize(x)
    with pytest.raises(FormatError):
        formats.quantize_index(x, "mxfp4", torch.float8_e4m3fn)


def test_mxfp4_shape_and_dtype_errors() -> None:
    with pytest.raises(FormatError):
        formats.mxfp4_quantize(torch.randn(2, 48))
    codes, exps = formats.mxfp4_quantize(torch.randn(2, 64))
    with pytest.raises(FormatError):
        formats.mxfp4_dequantize(codes.to(torch.int32), exps)
    with pytest.raises(FormatError):
        formats.mxfp4_dequantize(codes, exps[:, :1])


def _mx_amax(k: int, base: float, nudge: int) -> float:
    """base * 2^k as an FP32 number, moved `nudge` ulps (-1, 0, +1)."""
    t = torch.tensor(math.ldexp(base, k), dtype=torch.float32)
    if nudge:
        t = torch.nextafter(t, torch.tensor(float("inf") if nudge > 0 else 0.0))
    return float(t)


@st.composite
def mx_groups(draw: st.DrawFn) -> torch.Tensor:
    """One or more 32-element groups: random values, the amax element set to a chosen value,
    often exactly 6 * 2^k (or 2^k, 3 * 2^k) or one ulp either side of it."""
    n_groups = draw(st.integers(1, 3))
    out = []
    for _ in range(n_groups):
        if draw(st.integers(0, 3)) == 0:
            amax = draw(st.floats(2.0 ** -123, 2.0 ** 123, width=32))
        else:
            amax = _mx_amax(draw(st.integers(-133, 124)), draw(st.sampled_from([6.0, 1.0, 3.0])),
                            draw(st.sampled_from([-1, 0, 0, 1])))
        assert amax > 0 and math.isfinite(amax)
        u = draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=32, max_size=32))
        g = torch.tensor(u, dtype=torch.float32) * amax  # |g| <= amax (monotone rounding)
        j = draw(st.integers(0, 31))
        g[j] = amax if draw(st.booleans()) else -amax
        out.append(g)
    return torch.cat(out).reshape(1, -1)


@settings(max_examples=200, deadline=None)
@given(x=mx_groups())
def test_mxfp4_group_never_clips(x: torch.Tensor) -> None:
    codes, exps = formats.mxfp4_quantize(x)
    dq = formats.mxfp4_dequantize(codes, exps)
    groups = x.reshape(-1, 32).double()
    for gi in range(groups.shape[0]):
        amax = float(groups[gi].abs().max())
        e = int(exps[0, gi]) - 127
        # amax / 2^e <= 6 (no clipping), and e is the smallest such exponent.
        assert amax <= math.ldexp(6.0, e), (amax, e)
        assert e == -127 or amax > math.ldexp(6.0, e - 1), (amax, e)
        assert e == smallest_mx_exponent(amax)
        assert int(formats.mx_exponent(torch.tensor([amax], dtype=torch.float32))[0]) == e
        _check_nearest(groups[gi], dq[0, gi * 32:(gi + 1) * 32].double(), e)


def _check_nearest(x: torch.Tensor, dq: torch.Tensor, e: int) -> None:
    """Each decoded value is the nearest 2^e-scaled grid point, within 2^e * half the gap."""
    s = math.ldexp(1.0, e)
    grid = [m for m, _ in E2M1_POS]
    for xi, di in zip(x.tolist(), dq.tolist()):
        m = abs(xi) / s
        half_gap = 0.25 if m <= 2 else 0.5 if m <= 4 else 1.0
        err = abs(xi - di)
        assert err <= s * half_gap, (xi, di, e)
        nearest = min(abs(m - g) for g in grid) * s
        assert err == pytest.approx(nearest, rel=1e-12, abs=0.0), (xi, di, e)
        assert di == 0 or (di > 0) == (xi > 0)


@pytest.mark.parametrize("k", sorted(set(range(-127, 126, 7)) | {-126, 0, 1, 124}))
def test_mx_exponent_at_exact_six_times_powers(k: int) -> None:
    amax = torch.tensor([_mx_amax(k, 6.0, -1), _mx_amax(k, 6.0, 0), _mx_amax(k, 6.0, 1)])
    got = formats.mx_exponent(amax).tolist()
    want = [smallest_mx_exponent(float(a)) for a in amax]
    assert got == want
    if k > -127:
        assert want[1] == k and want[2] == k + 1 and want[0] == k


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), k=st.integers(-110, 110), outlier=st.floats(1, 100))
def test_mxfp4_round_trip_error_bound(seed: int, k: int, outlier: float) -> None:
    """Realistic rows (Gaussian with an outlier channel) over a wide range of magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(2, 128, generator=gen) * 2.0 ** k
    row[:, int(torch.randint(0, 128, (1,), generator=gen))] *= outlier
    codes, exps = formats.mxfp4_quantize(row)
    dq = formats.mxfp4_dequantize(codes, exps)
    for r in range(2):
        for gi in range(4):
            sl = slice(gi * 32, (gi + 1) * 32)
            _check_nearest(row[r, sl].double(), dq[r, sl].double(), int(exps[r, gi]) - 127)


# --------------------------------------------------------------------------------------------
# Cache-level layouts (spec sections 4 and 5)
# --------------------------------------------------------------------------------------------

def test_layouts_bytes_per_row() -> None:
    fn = torch.float8_e4m3fn
    assert formats.index_layout("mxfp4", 128, fn).bytes_per_row == 64 + 4
    assert formats.index_layout("mxfp4", 128, fn).code_shape == (64,)
    assert formats.index_layout("mxfp4", 128, fn).scale_shape == (4,)
    assert formats.index_layout("fp8", 128, fn).bytes_per_row == 128 + 4
    assert formats.index_layout("bf16", 128, fn).bytes_per_row == 256
    assert formats.kv_layout("fp8", 256, torch.float8_e4m3fnuz).bytes_per_row == 256 + 4
    assert formats.kv_layout("bf16", 256, fn).bytes_per_row == 512
    with pytest.raises(FormatError):
        formats.index_layout("fp4", 128, fn)
    with pytest.raises(FormatError):
        formats.kv_layout("mxfp4", 256, fn)
    with pytest.raises(FormatError):
        formats.kv_layout("fp8", 256, torch.float16)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_index_round_trip(fmt: str, dtype: torch.dtype) -> None:
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    codes, scale = formats.quantize_index(x, fmt, dtype)
    dq = formats.dequantize_index(codes, scale, fmt)
    rel = {"bf16": 2 ** -8, "fp8": 2 ** -3, "mxfp4": 0.5}[fmt]
    assert bool(((x - dq).abs() <= rel * x.abs().amax(-1, keepdim=True)).all())
    if fmt != "bf16":
        with pytest.raises(FormatError):
            formats.dequantize_index(codes, None, fmt)
