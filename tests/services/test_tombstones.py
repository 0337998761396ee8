from moemesh.shared.service.runtime import Tombstones


def test_an_abort_is_remembered_until_its_time_is_up():
    t = Tombstones(ttl_s=10.0)
    t.add("a", now=0.0)
    assert "a" in t._until and "b" not in t
    t.add("b", now=11.0)  # "a" has expired by then and is forgotten
    assert len(t) == 1


def test_memory_is_bounded_oldest_first():
    t = Tombstones(ttl_s=1e9, max_size=3)
    for rid in "abcde":
        t.add(rid)
    assert len(t) == 3 and "a" not in t and "b" not in t and all(r in t for r in "cde")
