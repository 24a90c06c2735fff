"""engine.multihost.max_op_bytes, the group stream's receive limit, holds the largest real operation of
each kind an engine publishes (encoded as services.group sends it)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine import multihost
from pdserve.engine.core.kv_groups import BlockTables
from pdserve.engine.lora_slots import SLOT_AXIS
from pdserve.engine.model.attention import block_table_width
from pdserve.engine.model.sampler import SamplingBatch, mask_words
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import MAX_FRAME_BYTES, KVChunk
from pdserve.services.group import to_message

pytestmark = pytest.mark.model


def test_the_largest_operation_of_each_kind_fits_the_bound(make_engine):
    engine = make_engine(max_loras=2)
    config, model = engine.config, engine.model.config
    bound = multihost.max_op_bytes(engine)
    rows = config.seq_bucket(config.max_num_batched_tokens)
    width = block_table_width(config)
    step = multihost.DeviceOp(
        "step",
        {
            "tokens": np.zeros(config.max_num_batched_tokens, np.int32),
            "cu_q_lens": np.zeros(rows + 1, np.int32),
            "kv_lens": np.zeros(rows, np.int32),
            "block_tables": np.zeros((1, rows, width), np.int32),
            "lora_slots": np.zeros(rows, np.int32),
        },
    )
    penalties = SamplingParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5)
    history = [(list(range(config.max_model_len // 2)), [1, 2, 3])] * rows
    allowed = np.zeros((rows, mask_words(model.vocab_size)), np.int32)  # every row constrained
    batch = SamplingBatch.build(
        [penalties] * rows,
        list(range(rows)),
        [7] * rows,
        [5] * rows,
        history,
        rows,
        model.vocab_size,
        allowed,
    )
    sample = multihost.sample_op(batch)
    kv = multihost.insert_op(
        KVChunk(0, 0, 16, np.zeros(MAX_FRAME_BYTES // 4, np.float32)), BlockTables.of(list(range(width)))
    )
    slot = {  # one adapter's arrays: each slot array without its slot axis
        name: np.zeros(np.delete(leaf.shape, SLOT_AXIS[name]), np.float32)
        for name, leaf in vars(engine.lora_slots.weights).items()
    }
    lora = multihost.DeviceOp("lora_write", slot, {"slot": 1})
    sizes = {op.kind: to_message(op, 0).ByteSize() for op in (step, sample, kv, lora)}
    assert all(size <= bound for size in sizes.values()), (sizes, bound)
    assert bound < 64 << 20  # far under the 1 GiB it replaces, for the tests' engine
