import random

from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.shared.transport.staging import ALIGN, RangeAllocator, StagingPool, mapping_fields


def test_alloc_free_coalesces_back_to_one_range():
    a = RangeAllocator(4096)
    x, y, z = a.alloc(1000), a.alloc(1000), a.alloc(1000)
    assert x == 0 and y == 1024 and z == 2048
    assert a.alloc(2048) is None
    a.free(y)
    a.free(x)
    a.free(z)
    a.check()
    assert a.alloc(4096) == 0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.integers(0, 10_000))
def test_random_alloc_free_never_overlaps_or_leaks(sizes, seed):
    rng = random.Random(seed)
    a = RangeAllocator(64 * 1024)
    live = {}
    for n in sizes:
        if live and rng.random() < 0.4:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        off = a.alloc(n)
        if off is not None:
            assert off % ALIGN == 0
            for o, m in live.items():
                assert off + n <= o or o + m <= off
            live[off] = n
        a.check()
    for off in list(live):
        a.free(off)
    a.check()
    assert a.bytes_used == 0 and a.alloc(64 * 1024) == 0


def test_pool_slots_are_views_of_one_buffer():
    import torch

    pool = StagingPool(1 << 16)
    s = pool.alloc(1000)
    s.typed(torch.float32, (250,)).fill_(2.0)
    assert pool.buf[s.offset : s.offset + 4].view(torch.float32).item() == 2.0
    assert s.buffer().nbytes == 1000
    pool.free(s)
    assert pool.bytes_used == 0


def test_host_staging_sits_on_huge_page_eligible_memory():
    """Transfers between processes read the sender's pages through the kernel, and on
    4 KiB pages 1-16 MiB moved 1.6-1.7x slower here; the pool asks for huge pages."""
    import pathlib

    import pytest

    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    pool = StagingPool(6 << 20)
    assert pool.buf.data_ptr() % (2 << 20) == 0 and pool.buf.numel() == 6 << 20
    flags = mapping_fields(pool.buf.data_ptr())
    if "THPeligible" not in flags:
        pytest.skip("this kernel's smaps does not say whether a mapping may use huge pages")
    assert flags["THPeligible"] == "1"
    # How much the kernel granted is its own affair; what is reported is this pool's, even
    # where the kernel merged the mappings of pools made one after another into one entry.
    others = [StagingPool(6 << 20) for _ in range(3)]
    assert all(0 <= p.huge_page_bytes() <= 6 << 20 for p in [pool, *others])
    slot = pool.alloc(3 << 20)
    slot.tensor.fill_(5)  # writable, and the view stays inside the mapping
    assert int(pool.buf[: 3 << 20].sum()) == 5 * (3 << 20)
