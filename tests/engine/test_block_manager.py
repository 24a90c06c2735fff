import pytest

from engine.block_manager import BlockAllocator, BlockTable, OutOfBlocksError, blocks_for_tokens

pytestmark = pytest.mark.fast


def test_allocate_and_free_round_trip():
    alloc = BlockAllocator(8)
    assert alloc.can_allocate(8) and not alloc.can_allocate(9)
    blocks = alloc.allocate(5)
    assert len(set(blocks)) == 5 and alloc.num_free == 3 and alloc.num_used == 5
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(4)
    alloc.free(blocks)
    assert alloc.num_free == 8


def test_double_free_is_an_error():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(blocks[:1])


def test_block_table_grows_by_whole_blocks():
    alloc = BlockAllocator(10)
    table = BlockTable(alloc, block_size=4)
    assert table.blocks_needed(1) == 1 and blocks_for_tokens(9, 4) == 3
    table.reserve(5)
    assert len(table.block_ids) == 2
    table.reserve(8)  # still fits in two blocks
    assert len(table.block_ids) == 2
    table.reserve(9)
    assert len(table.block_ids) == 3
    assert not table.can_reserve(4 * 11)
    table.release()
    assert table.block_ids == [] and alloc.num_free == 10


def test_freed_blocks_are_reused_out_of_order():
    """After frees in another order, new tables get non-contiguous block ids (the scattered case)."""
    alloc = BlockAllocator(6)
    a, b, c = (alloc.allocate(2) for _ in range(3))
    alloc.free(b)
    alloc.free(a)
    assert alloc.allocate(4) == b + a
    del c
