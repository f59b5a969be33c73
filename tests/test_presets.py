"""Model presets (spec section 1): the default values, the TP2 variant, immutability, and
validation errors that name the offending field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa.presets import PRESETS, ModelPreset, ShapeError, get_preset

NAME = "qwen3.8-flash-next"


def _raises_naming(field: str, fn, *args, **kwargs) -> ShapeError:
    """Call fn, expect a ShapeError whose message starts with the field name."""
    with pytest.raises(ShapeError) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(f"{field}:"), str(info.value)
    return info.value


def test_default_preset_matches_spec_section_1() -> None:
    p = get_preset(NAME)
    assert p.name == NAME
    # 12 QSA layers of 48: every 4th, starting at layer 3.
    assert p.qsa_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47)
    assert (p.num_q_heads, p.num_kv_heads, p.head_dim) == (24, 2, 256)
    assert p.gqa_group == 12
    assert (p.index_heads, p.index_dim) == (4, 128)
    assert p.compress_ratio == 4
    assert p.topk_groups == 512
    assert p.token_budget == 2048
    assert p.expand_width == 4 * 512 + 3 == 2051
    assert p.block_size == 64
    assert p.groups_per_block == 16
    assert p.max_context == 262_144
    assert p.mtp_draft_tokens == 3 and p.rows_per_verify == 4
    assert p.draft_layers == 1
    assert p.softmax_scale == 1 / 16
    assert math.isclose(p.index_scale, 1 / math.sqrt(128), rel_tol=1e-15)
    assert p.rope_dims == 64 and p.rope_theta == 1e7
    assert p.tensor_parallel == 1


def test_default_is_the_registered_default() -> None:
    assert get_preset() is PRESETS[NAME]


def test_tp2_variant() -> None:
    base = get_preset(NAME)
    tp2 = base.tensor_parallel_shard(2)
    assert (tp2.num_q_heads, tp2.num_kv_heads) == (12, 1)
    assert tp2.gqa_group == 12
    assert tp2.tensor_parallel == 2
    # The indexer is replicated, not split; everything else is unchanged.
    assert (tp2.index_heads, tp2.index_dim, tp2.head_dim) == (4, 128, 256)
    assert tp2.qsa_layers == base.qsa_layers and tp2.topk_groups == 512
    registered = [p for p in PRESETS.values() if p.tensor_parallel == 2]
    assert registered == [tp2]
    assert get_preset(tp2.name) == tp2


def test_tp_shard_rejects_degree_not_dividing_kv_heads() -> None:
    _raises_naming("tensor_parallel", get_preset(NAME).tensor_parallel_shard, 4)
    _raises_naming("tensor_parallel", get_preset(NAME).tensor_parallel_shard, 0)


def test_frozen() -> None:
    p = get_preset(NAME)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.block_size = 16  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_q_heads = 1  # type: ignore[misc]
    assert p.block_size == 64


def test_replace_returns_validated_copy() -> None:
    p = get_preset(NAME)
    q = p.replace(block_size=16)
    assert q.block_size == 16 and q.groups_per_block == 4 and p.block_size == 64
    assert get_preset(NAME, topk_groups=8).token_budget == 32


@pytest.mark.parametrize("bs", [16, 32, 64, 128, 4, 260])
def test_block_sizes_multiple_of_4_are_valid(bs: int) -> None:
    assert get_preset(NAME).replace(block_size=bs).block_size == bs


@pytest.mark.parametrize("bs", [0, 2, 6, 30, 65, 130, -4])
def test_block_size_not_multiple_of_4(bs: int) -> None:
    _raises_naming("block_size", get_preset(NAME).replace, block_size=bs)


@pytest.mark.parametrize("q,kv", [(25, 2), (24, 5), (7, 2), (12, 8)])
def test_heads_not_divisible_by_kv_heads(q: int, kv: int) -> None:
    _raises_naming("num_q_heads", get_preset(NAME).replace, num_q_heads=q, num_kv_heads=kv)


@pytest.mark.parametrize("h", [0, 9, -1])
def test_index_heads_out_of_range(h: int) -> None:
    _raises_naming("index_heads", get_preset(NAME).replace, index_heads=h)


def test_index_heads_1_to_8_are_valid() -> None:
    for h in range(1, 9):
        assert get_preset(NAME).replace(index_heads=h).index_heads == h


@pytest.mark.parametrize("field,value", [
    ("head_dim", 96), ("head_dim", 512), ("head_dim", 32),
    ("index_dim", 48), ("index_dim", 16),
    ("compress_ratio", 8), ("topk_groups", 0), ("mtp_draft_tokens", 8),
    ("rope_dims", 63), ("rope_dims", 256), ("rope_theta", 1.0), ("rope_theta", float("nan")),
    ("rms_eps", 0.0), ("num_kv_heads", 0), ("block_size", True), ("block_size", 64.0),
    ("max_context", 32),
])
def test_invalid_field_named(field: str, value: object) -> None:
    _raises_naming(field, get_preset(NAME).replace, **{field: value})


def test_unknown_field_in_replace() -> None:
    _raises_naming("block_sise", get_preset(NAME).replace, block_sise=16)
    _raises_naming("nope", get_preset, NAME, nope=1)


def test_unknown_preset_name() -> None:
    err = _raises_naming("preset", get_preset, "qwen9-giant")
    assert "qwen9-giant" in str(err)


@settings(max_examples=60, deadline=None)
@given(kv=st.integers(1, 8), group=st.integers(1, 16), head_dim=st.sampled_from([64, 128, 256]),
       index_heads=st.integers(1, 8), index_dim=st.sampled_from([32, 64, 128, 256]),
       blocks_of_4=st.integers(1, 64), topk=st.integers(1, 4096),
       mtp=st.integers(0, 7), tp2=st.booleans())
def test_valid_overrides(kv: int, group: int, head_dim: int, index_heads: int, index_dim: int,
                         blocks_of_4: int, topk: int, mtp: int, tp2: bool) -> None:
    p = get_preset(NAME).replace(
        num_kv_heads=kv, num_q_heads=kv * group, head_dim=head_dim, index_heads=index_heads,
        index_dim=index_dim, rope_dims=min(64, index_dim), block_size=4 * blocks_of_4,
        topk_groups=topk, mtp_draft_tokens=mtp)
    assert p.gqa_group == group
    assert p.token_budget == 4 * topk
    assert p.expand_width == 4 * topk + 3
    assert p.rows_per_verify == mtp + 1
    assert p.groups_per_block == blocks_of_4
    assert p.softmax_scale == pytest.approx(1 / math.sqrt(head_dim), rel=1e-15)
    assert p.index_scale == pytest.approx(1 / math.sqrt(index_dim), rel=1e-15)
    assert ModelPreset(**p.as_dict()) == p
    if tp2 and kv % 2 == 0:
        s = p.tensor_parallel_shard(2)
        assert (s.num_q_heads, s.num_kv_heads, s.gqa_group) == (kv * group // 2, kv // 2, group)


@settings(max_examples=40, deadline=None)
@given(bs=st.integers(-64, 600).filter(lambda b: b <= 0 or b % 4 != 0))
def test_invalid_block_sizes_property(bs: int) -> None:
    _raises_naming("block_size", get_preset(NAME).replace, block_size=bs)
