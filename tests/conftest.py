"""Where `make test`'s time goes (issue 28): at the end of every run, each tier's time beside its
budget, split into set-up (fixtures: control planes, operators, engines and processes starting),
the tests' own calls (their requests, waits and assertions) and teardown. A tier over its budget is
a loud line, not a failed test: the budgets are what `make test` must fit in 20 minutes on an idle
2-core machine, and a figure is a measurement, not a verdict.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

# Seconds per tier; their sum is make test's goal (20 minutes). The path under tests/ names the tier.
BUDGETS = {
    "unit": 90,
    "engine": 240,
    "connector": 60,
    "standin": 60,
    "cluster": 420,
    "cluster/real": 330,
}

_SPENT: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_COUNT: dict[str, int] = defaultdict(int)


def tier(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) < 3 or parts[0] != "tests":
        return "other"
    if parts[1] == "cluster" and len(parts) > 3 and parts[2] in ("real", "kind"):
        return f"cluster/{parts[2]}"
    return parts[1]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SPENT[tier(report.nodeid)][report.when] += report.duration
    if report.when == "call":
        _COUNT[tier(report.nodeid)] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _SPENT:
        return
    tr = terminalreporter
    tr.section("where the time went, by tier (seconds)")
    tr.write_line(f"{'tier':<14} {'tests':>6} {'set-up':>8} {'calls':>8} {'teardown':>9} {'total':>8} {'budget':>7}")
    total = 0.0
    for name in sorted(_SPENT):
        s = _SPENT[name]
        spent = s["setup"] + s["call"] + s["teardown"]
        total += spent
        budget = BUDGETS.get(name)
        over = budget is not None and spent > budget
        line = (f"{name:<14} {_COUNT[name]:>6} {s['setup']:>8.0f} {s['call']:>8.0f} {s['teardown']:>9.0f} "
                f"{spent:>8.0f} {budget if budget is not None else '-':>7}")
        tr.write_line(line + (f"   OVER BUDGET by {spent - budget:.0f} s" if over else ""), red=over, bold=over)
    goal = sum(BUDGETS.values())
    tr.write_line(f"{'all':<14} {sum(_COUNT.values()):>6} {'':>8} {'':>8} {'':>9} {total:>8.0f} {goal:>7}"
                  + (f"   OVER the {goal} s goal" if total > goal else ""), red=total > goal, bold=total > goal)
