import zlib

from moemesh.services.kv_store.tiers import DiskTier, MemoryTier


def _blk(i: int, n: int = 100) -> tuple[bytes, bytes, int]:
    data = bytes([i % 256]) * n
    return bytes([i]) * 16, data, zlib.crc32(data)


def test_memory_tier_lru_capacity_and_pins():
    t = MemoryTier(350)
    for i in range(3):
        assert t.put(*_blk(i)) == []
    t.get(_blk(0)[0])  # 0 is now the most recently used
    evicted = t.put(*_blk(3))
    assert [e[0] for e in evicted] == [_blk(1)[0]] and t.used == 300
    t.pin(_blk(2)[0])
    evicted = t.put(*_blk(4))  # 2 is pinned (being read): 0 goes instead, despite being newer
    assert [e[0] for e in evicted] == [_blk(0)[0]] and _blk(2)[0] in t
    t.pin(_blk(3)[0])
    t.pin(_blk(4)[0])
    assert t.put(*_blk(5)) is None and t.used == 300  # everything pinned: refused, nothing lost
    t.unpin(_blk(4)[0])
    assert t.put(*_blk(5)) is not None and _blk(4)[0] not in t


def test_disk_tier_survives_restart_and_never_serves_corrupt_blocks(tmp_path):
    d = DiskTier(tmp_path, 10_000)
    for i in range(3):
        d.put(*_blk(i))
    again = DiskTier(tmp_path, 10_000)
    assert set(again.hashes()) == {_blk(i)[0] for i in range(3)}
    assert again.get(_blk(1)[0]) == (_blk(1)[1], _blk(1)[2])
    f = tmp_path / f"{_blk(2)[0].hex()}.kvb"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert again.get(_blk(2)[0]) is None and _blk(2)[0] not in again and again.corrupt == 1
    assert not f.exists()


def test_disk_tier_capacity_evicts_oldest(tmp_path):
    d = DiskTier(tmp_path, 3 * 130)
    gone = [g for i in range(5) for g in d.put(*_blk(i))]
    assert gone == [_blk(0)[0], _blk(1)[0]] and len(d) == 3
