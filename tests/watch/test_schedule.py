"""The pure Schedule: fixed intervals, the overhead budget under synthetic durations, state."""

from __future__ import annotations

import json
import math
import random

import pytest

from gradwatch.watch.schedule import MAX_AUTO_INTERVAL, Schedule


def simulate(schedule: Schedule, steps: int, step_seconds, check_seconds, start: int = 0, fractions=None):
    """Drive ``schedule`` like the hook does, with synthetic durations (no clock).

    Returns ``(check steps, check time, training time)``. When ``fractions`` is a list,
    the share of time spent in checks *before* each check (over the complete
    check cycles so far) is appended to it.
    """
    checks, check_total, train_total = [], 0.0, 0.0
    for step in range(start, start + steps):
        if step > start:
            schedule.record_step_seconds(step_seconds(step))
        if schedule.due(step):
            if fractions is not None and checks:
                fractions.append(check_total / (check_total + train_total))
            c = check_seconds(step)
            schedule.record_check(step, c)
            checks.append(step)
            check_total += c
        train_total += step_seconds(step)
    return checks, check_total, train_total


@pytest.mark.parametrize("every", [1, 3, 10])
def test_every_n_checks_first_step_then_every_n(every):
    s = Schedule(every=every)
    checks, _, _ = simulate(s, 50, lambda i: 0.1, lambda i: 5.0)  # durations do not matter
    assert checks == list(range(0, 50, every))


def test_every_n_counts_from_the_first_step_seen():
    s = Schedule(every=4)
    checks, _, _ = simulate(s, 12, lambda i: 0.1, lambda i: 1.0, start=7)
    assert checks == [7, 11, 15]
    assert s.first_step == 7 and s.last_check_step == 15


@pytest.mark.parametrize("budget", [0.005, 0.02, 0.1, 0.5])
@pytest.mark.parametrize("step_s, check_s", [(0.01, 0.05), (0.2, 0.05), (0.005, 0.5)])
def test_auto_keeps_overhead_under_budget_with_constant_durations(budget, step_s, check_s):
    s = Schedule(every="auto", overhead_budget=budget)
    fractions = []
    checks, _, _ = simulate(s, 60_000, lambda i: step_s, lambda i: check_s, fractions=fractions)
    assert checks[0] == 0 and len(checks) >= 3
    assert max(fractions) <= budget * (1 + 1e-9)
    # it spends the budget rather than checking rarely for nothing: the smallest whole gap within it
    gap = math.ceil(check_s * (1 - budget) / (budget * step_s) - 1e-9)
    assert s.interval() == gap
    assert fractions[-1] == pytest.approx(check_s / (check_s + gap * step_s), rel=1e-3)


def test_auto_keeps_overhead_under_budget_with_noisy_durations():
    """Estimates from a few noisy samples: within 10% of the budget, and close to it."""
    rng = random.Random(0)
    steps = {i: 0.02 * rng.uniform(0.8, 1.2) for i in range(40_000)}
    checks_s = {i: 0.5 * rng.uniform(0.8, 1.2) for i in range(40_000)}
    s = Schedule(every="auto", overhead_budget=0.02)
    fractions = []
    checks, _, _ = simulate(s, 40_000, steps.__getitem__, checks_s.__getitem__, fractions=fractions)
    assert len(checks) > 20
    assert max(fractions) <= 0.02 * 1.1
    assert fractions[-1] >= 0.02 * 0.9


def test_auto_budget_counts_the_mean_check_cost():
    """Rotating subsets: cheap and expensive checks alternate; the mean cost sets the gap."""
    s = Schedule(every="auto", overhead_budget=0.02)
    fractions = []
    costs = {}

    def check_seconds(step):
        costs[step] = 0.1 if len(costs) % 3 else 1.0  # one expensive check in three
        return costs[step]

    simulate(s, 60_000, lambda i: 0.01, check_seconds, fractions=fractions)
    assert max(fractions[3:]) <= 0.02 * 1.05


def test_auto_interval_is_capped():
    s = Schedule(every="auto", overhead_budget=0.001)
    s.record_check(0, 1e6)
    s.record_step_seconds(1e-6)
    assert s.interval() == MAX_AUTO_INTERVAL


def test_auto_adapts_when_steps_get_faster():
    s = Schedule(every="auto", overhead_budget=0.05)
    slow, _, _ = simulate(s, 2_000, lambda i: 0.1, lambda i: 0.5)
    gap_slow = s.interval()
    fast, _, _ = simulate(s, 2_000, lambda i: 0.01, lambda i: 0.5, start=2_000)
    assert s.interval() > 5 * gap_slow  # faster steps: the same check is a bigger share, so rarer
    gaps = [b - a for a, b in zip(fast, fast[1:])]
    assert gaps[-1] == s.interval()


def test_auto_interval_formula_and_first_check():
    s = Schedule(every="auto", overhead_budget=0.02)
    assert s.due(0) and s.interval() == 1  # nothing measured yet
    s.record_check(0, 1.0)
    assert s.interval() == 1  # no step duration yet: check again at the next step
    s.record_step_seconds(0.1)
    assert s.interval() == 490  # 1.0 * 0.98 / (0.02 * 0.1)
    assert not s.due(489) and s.due(490)


def test_auto_checks_every_step_when_checks_are_free():
    s = Schedule(every="auto", overhead_budget=0.5)
    s.record_check(0, 0.0)
    s.record_step_seconds(1.0)
    assert s.interval() == 1


def test_bad_durations_are_ignored():
    s = Schedule(every="auto")
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        s.record_step_seconds(bad)
    s.record_check(0, float("nan"))
    assert s.state_dict()["step_seconds"] == [] and s.state_dict()["check_seconds"] == []
    assert s.interval() == 1


def test_a_step_before_the_last_check_restarts_the_schedule():
    s = Schedule(every=10)
    checks, _, _ = simulate(s, 25, lambda i: 0.1, lambda i: 0.1)
    assert checks == [0, 10, 20]
    # a new fit from step 0 with the same schedule (or a rewind to an earlier checkpoint)
    again, _, _ = simulate(s, 25, lambda i: 0.1, lambda i: 0.1)
    assert again == [0, 10, 20]


@pytest.mark.parametrize("every", [5, "auto"])
def test_state_dict_round_trip_continues_the_same_schedule(every):
    rng = random.Random(1)
    step_s = {i: rng.uniform(0.01, 0.02) for i in range(3_000)}
    check_s = {i: rng.uniform(0.1, 0.3) for i in range(3_000)}
    whole = Schedule(every=every, overhead_budget=0.05)
    expected, _, _ = simulate(whole, 3_000, step_s.__getitem__, check_s.__getitem__)

    first = Schedule(every=every, overhead_budget=0.05)
    got, _, _ = simulate(first, 1_234, step_s.__getitem__, check_s.__getitem__)
    state = json.loads(json.dumps(first.state_dict()))
    second = Schedule(every=every, overhead_budget=0.05)
    second.load_state_dict(state)
    # the hook records no step duration for the first step after a resume
    rest = []
    for step in range(1_234, 3_000):
        if step > 1_234:
            second.record_step_seconds(step_s[step])
        if second.due(step):
            second.record_check(step, check_s[step])
            rest.append(step)
    assert got + rest == expected
    assert second.state_dict() == whole.state_dict()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "every: got 0"),
        ({"every": -1}, "every: got -1"),
        ({"every": True}, "every: got True"),
        ({"every": 2.5}, "every: got 2.5"),
        ({"every": "sometimes"}, "every: got 'sometimes'"),
        ({"overhead_budget": 0}, "overhead_budget: got 0"),
        ({"overhead_budget": 1.5}, "overhead_budget: got 1.5"),
        ({"window": 0}, "window: got 0"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


def test_auto_is_case_insensitive():
    assert Schedule(every="AUTO").every == "auto"
