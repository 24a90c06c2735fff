"""How weights travel from a checkpoint to the devices (engine.model.weights.build_weights): a safetensors
tensor is read as a view of its file's pages, fused arrays are built with one contiguous copy per part,
and the reads run ahead of the writes on a few threads, in order."""

from __future__ import annotations

import json
import threading

import ml_dtypes
import numpy as np
import pytest

from pdserve.engine.loading.checkpoints import SafetensorsCheckpoint
from pdserve.engine.model.weights import _in_order, stack_in_place

pytestmark = pytest.mark.fast


def test_a_safetensors_tensor_is_read_as_a_read_only_view_of_its_file(tmp_path):
    """Each stored dtype comes back with the values safetensors itself reads, as a view of the file (no
    copy of its own: the devices' copy is the only one), rows of it too; an empty tensor reads as one."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.normal(size=(32, 16)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": rng.normal(size=16).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.normal(size=(16, 16)).astype(np.float16),
        "empty": np.zeros((0, 16), np.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 32,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "tie_word_embeddings": True,
            }
        )
    )
    with (
        SafetensorsCheckpoint(tmp_path).reader() as reader,
        safe_open(tmp_path / "model.safetensors", "np") as f,
    ):
        for key, stored in tensors.items():
            w = reader.tensor(key)
            assert w.dtype == stored.dtype and w.shape == stored.shape
            np.testing.assert_array_equal(w, f.get_tensor(key))
            if w.size:
                assert not w.flags.owndata and not w.flags.writeable, key
        np.testing.assert_array_equal(
            reader.tensor("model.embed_tokens.weight", slice(5, 9)), tensors["model.embed_tokens.weight"][5:9]
        )
        assert reader.tensor("absent") is None


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -2])
def test_stack_in_place_is_np_stack_with_each_part_one_block(transposed, axis):
    """The same values as np.stack at every axis; each array's part of the result is one block of memory
    in the array's own order (the new axis outermost), so a stored tensor's transposed view is copied
    row by row, never element by element."""
    rng = np.random.default_rng(1)
    parts = [rng.normal(size=(2, 6, 4)).astype(ml_dtypes.bfloat16) for _ in range(3)]
    if transposed:
        parts = [p.transpose(0, 2, 1) for p in parts]
    stacked = stack_in_place(parts, axis)
    np.testing.assert_array_equal(stacked, np.stack(parts, axis))
    new_axis = axis % stacked.ndim
    assert stacked.strides[new_axis] == max(stacked.strides)  # the new axis outermost in memory
    for i in range(3):
        part = stacked[(slice(None),) * new_axis + (i,)]  # (a view)
        order = sorted(range(part.ndim), key=lambda a: -part.strides[a])
        assert part.transpose(order).flags.c_contiguous  # one block, in the part's own memory order
        assert order == sorted(range(part.ndim), key=lambda a: -parts[i].strides[a])


def test_reads_run_ahead_in_order_and_at_most_workers_ahead():
    """Results come back in the tasks' order even when a later task finishes first, and no task starts
    more than `workers` tasks ahead of the one the caller is consuming (the host's bound of layers held
    at once)."""
    workers, n = 2, 8
    started, consumed = [], []
    second_done = threading.Event()
    lock = threading.Lock()

    def task(i: int) -> int:
        with lock:
            started.append(i)
            assert i <= len(consumed) + workers, (i, consumed)
        if i == 0:
            assert second_done.wait(timeout=60)  # task 1 finishes before task 0
        if i == 1:
            second_done.set()
        return i

    for result in _in_order([lambda i=i: task(i) for i in range(n)], workers):
        consumed.append(result)
    assert consumed == list(range(n)) and sorted(started) == list(range(n))


def test_a_failing_read_ends_the_load_with_its_error():
    """A task's exception (a tensor missing from a layer, say) reaches the caller as itself."""

    def fail():
        raise KeyError("model.layers.3.mlp.down_proj.weight")

    with pytest.raises(KeyError, match="down_proj"):
        list(_in_order([lambda: 1, fail, lambda: 3], 2))
