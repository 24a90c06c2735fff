"""Layout: fingerprint, compatibility errors, head padding/replication, head_dim padding, specs."""

import numpy as np
import pytest
from kvtransfer_testlib import make_layout

from pdserve.kvtransfer import KVLayout, LayerSpec, LayoutMismatchError, SpecKind, head_map

pytestmark = pytest.mark.fast


def test_fingerprint_ignores_physical_choices_and_covers_logical_fields():
    base = make_layout()
    assert base.fingerprint() == make_layout(tp=4, strategy="replicate", head_dim_multiple=128).fingerprint()
    assert base.fingerprint() != make_layout(dtype="bfloat16").fingerprint()
    assert base.fingerprint() != make_layout(block_size=8).fingerprint()
    assert base.fingerprint() != make_layout("sliding").fingerprint()


def test_mismatch_error_names_every_differing_field():
    base = make_layout()
    with pytest.raises(LayoutMismatchError) as err:
        base.check_compatible(make_layout(dtype="bfloat16", block_size=8))
    assert err.value.differences == ["dtype: 'float32' != 'bfloat16'", "block_size: 4 != 8"]
    changed = KVLayout(
        "tiny", (LayerSpec(),) * 3 + (LayerSpec(SpecKind.SLIDING, sliding_window=64),), 3, 8, "float32", 4
    )
    with pytest.raises(LayoutMismatchError, match=r"layer 3: full != sliding\(64\)"):
        base.check_compatible(changed)
    with pytest.raises(LayoutMismatchError, match="num_kv_heads: 3 != 4"):
        base.check_compatible(KVLayout("tiny", (LayerSpec(),) * 4, 4, 8, "float32", 4))
    base.check_compatible(make_layout(tp=2))  # physical differences are fine


@pytest.mark.parametrize(
    ("tp", "strategy", "heads", "replication"),
    [(1, "pad", 3, 1), (2, "pad", 4, 1), (4, "pad", 4, 1), (2, "replicate", 6, 2), (4, "replicate", 12, 4)],
)
def test_kv_heads_padded_or_replicated_to_tp(tp, strategy, heads, replication):
    layout = make_layout(tp=tp, strategy=strategy)
    assert layout.padded_num_kv_heads == heads and layout.padded_num_kv_heads % tp == 0
    assert layout.num_head_slots == 2 * heads and layout.replication == replication


def test_head_dim_padding_and_mla_segments():
    assert make_layout(head_dim_multiple=128).token_shape == (6, 128)
    mla = make_layout("mla", head_dim_multiple=128, tp=4)
    assert mla.token_shape == (1, 256) and mla.head_dim_segments == ((0, 12), (128, 4))
    assert mla.heads_mesh_axis is None  # one latent head: replicated, not sharded
    int8 = make_layout(dtype="int8", head_dim_multiple=128)  # each row's scale after its padded values
    assert int8.token_shape == (6, 130) and int8.head_dim_segments == ((0, 8), (128, 2))
    assert make_layout("mla", dtype="int8").head_dim_segments == ((0, 12), (12, 4), (16, 2))


def test_specs_shared_layers_own_no_cache_and_sliding_windows_skip_old_blocks():
    layout = make_layout("sliding")
    assert layout.cache_layers == (0, 1, 3, 4) and layout.num_cache_layers == 4
    assert layout.cache_shape(8) == (4, 8, 4, 6, 8)
    # 21 tokens, window 8: tokens >= 13 matter, so blocks from 13 // 4 = 3 on.
    assert [layout.first_needed_block(i, 21) for i in range(4)] == [0, 3, 0, 3]
    assert layout.first_needed_block(1, 5) == 0


def test_invalid_layouts_are_rejected():
    with pytest.raises(ValueError, match="multiple of dp_size"):
        make_layout().with_physical(dp_size=3).cache_shape(8)
    with pytest.raises(ValueError, match="not an earlier cache layer"):
        KVLayout("m", (LayerSpec(SpecKind.SHARED, shared_with=0),), 1, 8, "float32", 4)
    with pytest.raises(ValueError, match="mixes MLA"):
        KVLayout(
            "m",
            (LayerSpec(SpecKind.MLA), LayerSpec()),
            1,
            8,
            "float32",
            4,
            kv_lora_rank=4,
            qk_rope_head_dim=4,
        )
    with pytest.raises(ValueError, match="dtype"):
        make_layout(dtype="int4")


def test_json_round_trip():
    layout = make_layout("sliding", dtype="bfloat16", tp=2, strategy="replicate")
    assert KVLayout.from_json(layout.to_json()) == layout


def test_head_map_pad_keeps_real_heads_and_zeroes_dummies():
    src, dst = make_layout(tp=1), make_layout(tp=4)  # 3 heads -> 4 (one dummy)
    x = np.arange(6 * 8, dtype=np.float32).reshape(1, 6, 8) + 1
    out = np.full((1, 8, 8), np.nan, np.float32)
    head_map(src, dst).apply_numpy(x, out)
    np.testing.assert_array_equal(out[0, :6], x[0])
    assert (out[0, 6:] == 0).all()
    back = np.empty_like(x)
    head_map(dst, src).apply_numpy(out, back)
    np.testing.assert_array_equal(back, x)


def test_head_map_replicate_repeats_each_kv_pair():
    src, dst = make_layout(tp=1), make_layout(tp=2, strategy="replicate")  # 3 heads -> 6 (each twice)
    x = np.arange(6 * 8, dtype=np.float32).reshape(1, 6, 8)
    out = np.empty((1, 12, 8), np.float32)
    hm = head_map(src, dst)
    hm.apply_numpy(x, out)
    # physical head p holds kv head p // 2: slots (2p, 2p+1) = source slots (2h, 2h+1)
    assert hm.head_index == (0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5)
    np.testing.assert_array_equal(out[0, 2:4], x[0, 0:2])
    np.testing.assert_array_equal(out[0, 10:12], x[0, 4:6])
    np.testing.assert_array_equal(np.asarray(hm.apply_jax(x)), out)


def test_head_map_mla_moves_rope_part_with_padding():
    src, dst = make_layout("mla"), make_layout("mla", head_dim_multiple=128)
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 16) + 1
    out = np.full((1, 1, 256), np.nan, np.float32)
    head_map(src, dst).apply_numpy(x, out)
    np.testing.assert_array_equal(out[0, 0, :12], x[0, 0, :12])
    np.testing.assert_array_equal(out[0, 0, 128:132], x[0, 0, 12:16])
    assert (out[0, 0, 12:128] == 0).all() and (out[0, 0, 132:] == 0).all()


def test_head_map_identity_between_equal_physical_layouts():
    assert head_map(make_layout(tp=2), make_layout(tp=2)).is_identity
    assert not head_map(make_layout(tp=1), make_layout(tp=2)).is_identity
    with pytest.raises(LayoutMismatchError):
        head_map(make_layout(), make_layout(dtype="bfloat16"))
