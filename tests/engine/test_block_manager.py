import pytest

from moemesh.shared.engine.block_manager import BlockManager


def test_allocate_free_and_exact_accounting():
    bm = BlockManager(8, 16)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1)
    with pytest.raises(MemoryError):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free_blocks == 3 and sorted(a + b) == list(range(8))
    bm.check()


def test_shared_block_returns_only_after_last_reference():
    bm = BlockManager(4, 16)
    a = bm.allocate(2)
    bm.share(a)
    bm.free(a)
    assert bm.num_free_blocks == 2 and bm.ref_count(a[0]) == 1
    bm.free(a)
    assert bm.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(a[:1])
    bm.check()


def test_blocks_for_rounds_up():
    bm = BlockManager(4, 16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
