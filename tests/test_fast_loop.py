"""tests/conftest.py's fast_loop_covers / fast_loop_keeps: the fast loop (``-m "not slow"``) runs each value of a
matrix at least once, and the whole suite every combination exactly once."""

import itertools

import pytest

from tests.conftest import fast_loop_covers, fast_loop_keeps


def split(params):
    slow = [tuple(p.values) for p in params if hasattr(p, "marks") and any(m.name == "slow" for m in p.marks)]
    fast = [p for p in params if not hasattr(p, "marks")]
    return fast, slow


@pytest.mark.parametrize("axes", [
    [["decoder", "encoder"], list("abcdefghijk"), ["explicit", "sdpa"], [3, 13]],  # generate's windowed cache
    [list("abcdefghijk"), ["sdpa", "explicit"], ["32", "bf16-mixed", "bf16-true"]],  # the precisions
    [list("123456"), list("abcdefghijk")],  # the variants
    [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]],  # the other axes' product (6) past the longest axis (5)
    [[1, 2, 3, 4], [1, 2, 3, 4]],  # two longest axes
    [[1, 2, 3], [1, 2, 3], [1, 2, 3]],  # the last axis's digit stays 0 over the longest axis's length
    [[7]],
])
def test_every_value_runs_in_the_fast_loop_and_every_combination_in_the_suite(axes):
    fast, slow = split(fast_loop_covers(*axes))
    assert sorted(fast + slow) == sorted(itertools.product(*axes))  # each combination once
    for i, axis in enumerate(axes):
        assert {combo[i] for combo in fast} == set(axis), f"axis {i}: a value only the slow tests run"
    assert len(fast) <= max(len(axis) for axis in axes) + sum(len(axis) for axis in axes)  # a handful, not the product


def test_the_kept_values_are_fast_and_the_rest_slow():
    fast, slow = split(fast_loop_keeps(["rope", "alibi", "none"], keep=["rope"]))
    assert fast == ["rope"] and slow == [("alibi",), ("none",)]
    fast, slow = split(fast_loop_keeps([("decoder", "rope"), ("encoder", "none")], keep=[("encoder", "none")]))
    assert fast == [("encoder", "none")] and slow == [("decoder", "rope")]
