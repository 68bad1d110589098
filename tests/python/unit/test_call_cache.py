"""smp.pipeline.cache.LRU: bounded, least recently used first out, reads refresh."""

from __future__ import annotations

import pytest

from smp.pipeline import cache


def test_keeps_the_most_recently_used_keys():
    table = cache.LRU(3)
    for key in "abc":
        table[key] = key.upper()
    assert table.get("a") == "A"  # a is now the most recent
    table["d"] = "D"  # b goes
    assert "b" not in table and len(table) == 3 and table.evicted == 1
    table.update({"e": "E", "f": "F"})  # c and a go
    assert [k for k in "abcdef" if k in table] == ["d", "e", "f"]
    assert table.evicted == 3
    table.add("g")
    assert "g" in table and table.get("g") is True and table.get("zzz", 0) == 0
    assert table.pop("g") is True and "g" not in table


def test_the_default_limit_is_read_when_a_table_is_made(monkeypatch):
    monkeypatch.setattr(cache, "CALL_CACHE_SIZE", 2)
    assert cache.LRU().limit == 2
    with pytest.raises(ValueError, match="limit=0"):
        cache.LRU(0)
