"""RequestRecord: what the decode side registers after a verified transfer."""

import pytest

from kvtransfer import RequestRecord

pytestmark = pytest.mark.fast


def make(**changes):
    fields = dict(
        request_id="r1",
        prompt_ids=[1, 2, 3, 4, 5],
        first_token=42,
        block_ids=[7, 3],
        num_computed_tokens=5,
        sampling_params={"temperature": 0.0, "seed": 3},
        lora_adapter="sql-lora",
    )
    return RequestRecord(**{**fields, **changes})


def test_record_holds_the_request_state():
    record = make()
    assert record.prompt_ids == (1, 2, 3, 4, 5) and record.block_ids == (7, 3)
    assert record.sampling_params["seed"] == 3 and record.lora_adapter == "sql-lora"
    record.check_blocks(block_size=4)
    moved = record.with_blocks([0, 1])
    assert moved.block_ids == (0, 1) and moved.prompt_ids == record.prompt_ids and moved.first_token == 42
    assert make(lora_adapter=None, sampling_params=object()).lora_adapter is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt_ids": []}, "prompt_ids is empty"),
        ({"num_computed_tokens": 6}, "outside"),
        ({"num_computed_tokens": 0}, "outside"),
        ({"first_token": -1}, "negative"),
        ({"block_ids": [3, 3]}, "distinct"),
    ],
)
def test_invalid_records_are_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        make(**changes)


def test_blocks_must_hold_exactly_the_computed_tokens():
    with pytest.raises(ValueError, match="2 blocks for 5 tokens, need 1"):
        make().check_blocks(block_size=8)
