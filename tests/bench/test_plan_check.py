"""plan-check's order of runs, without a mesh."""

from moemesh.tools.bench.plan_check import round_order


def test_every_other_round_runs_its_cases_backwards():
    assert round_order(["DEP4 balanced", "DEP4 skewed"], 3) == [
        (0, "DEP4 balanced"), (0, "DEP4 skewed"), (1, "DEP4 skewed"), (1, "DEP4 balanced"),
        (2, "DEP4 balanced"), (2, "DEP4 skewed")]


def test_over_an_even_number_of_rounds_each_case_follows_the_other_as_often():
    order = [c for _, c in round_order(["a", "b", "c"], 4)]
    assert sorted(order) == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    after = {}
    for prev, cur in zip(order, order[1:]):
        after[(prev, cur)] = after.get((prev, cur), 0) + 1
    assert after[("a", "b")] == after[("b", "a")] and after[("b", "c")] == after[("c", "b")]
