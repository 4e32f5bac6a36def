"""common/checked.py: what a check returned, kept per key; a key never seen (or one whose check
failed) is checked in full every time it comes; at most `kept` keys are kept."""

from __future__ import annotations

import pytest

from common.checked import CheckedOnce


def test_each_key_is_checked_once_and_a_failed_check_keeps_nothing():
    seen: list[int] = []

    def check(value: int) -> int:
        seen.append(value)
        if value < 0:
            raise ValueError(f"{value} is negative")
        return value * 2

    checked = CheckedOnce(check, kept=3)
    assert [checked.get("a", 1), checked.get("a", 1), checked.get("b", 2)] == [2, 2, 4]
    assert seen == [1, 2]
    for _ in range(2):
        with pytest.raises(ValueError, match="negative"):
            checked.get("bad", -1)
    assert seen == [1, 2, -1, -1] and len(checked) == 2
    checked.get("c", 3)
    checked.get("d", 4)  # a fourth key: it starts over rather than growing
    assert len(checked) == 1
    assert checked.get("a", 1) == 2 and seen[-1] == 1
