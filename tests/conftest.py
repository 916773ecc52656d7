"""Where `make test`'s time goes (issue 28): at the end of every run, each tier's time beside its
budget, split into set-up (fixtures: control planes, operators, engines and processes starting),
the tests' own calls (their requests, waits and assertions) and teardown. A tier over its budget is
a loud line, not a failed test: the budgets are what `make test` must fit in 20 minutes on an idle
2-core machine, and a figure is a measurement, not a verdict.

"waiting" is the part of set-up and calls spent in `time.sleep` on the test's own thread: the
intervals of every poll (each tier's wait_for) and any fixed sleep. What is left of a call is its
own work: requests, assertions, kubectl. The slowest modules are listed beneath, split the same way.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.standin import NO_CUDA_ENV
from tests.support import beside
from tests.support.beside import Beside

# Before any test imports vllm-omni, for this process and every one it starts (tests/standin says why).
os.environ.update(NO_CUDA_ENV)

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
_MODULES: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
SLOWEST_MODULES = 12

_real_sleep = time.sleep
_slept = [0.0]  # seconds the main thread spent in time.sleep so far


def _counted_sleep(seconds: float) -> None:
    if threading.current_thread() is not threading.main_thread():
        return _real_sleep(seconds)
    t0 = time.monotonic()
    try:
        return _real_sleep(seconds)
    finally:
        _slept[0] += time.monotonic() - t0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--negative-controls", action="store_true",
                     help="run the engine tier's negative controls beside this run (make test): started at "
                          "its start, waited for at its end; a failed control fails the run")
    parser.addoption("--tiers-beside", action="store_true",
                     help="run the unit, stand-in, connector and engine tiers (beside.TIERS_BESIDE) in a process "
                          "of their own beside this run, from its start (make test), instead of in it; a failure "
                          "there fails the run")


# The runs beside this one (tests/support/beside.py), started when collection ends.
_beside: list[Beside] = []
_finished: list[tuple[Beside, int, float, list[str]]] = []
_BESIDE_DIRS = {Path(__file__).parent / t for t in beside.TIERS_BESIDE}


def pytest_configure(config: pytest.Config) -> None:
    time.sleep = _counted_sleep  # modules that call time.sleep; a `from time import sleep` is not counted
    log = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    if config.getoption("--tiers-beside"):
        _beside.append(beside.unit_tier(Path(f"/tmp/omnistage-tests/unit-beside-{log}")))
        _beside.append(beside.engine_tiers(Path(f"/tmp/omnistage-tests/engine-tiers-beside-{log}")))
    if config.getoption("--negative-controls"):
        _beside.append(beside.negative_controls(Path(f"/tmp/omnistage-tests/negative-controls-{log}")))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("--tiers-beside") and collection_path in _BESIDE_DIRS:
        return True  # these tiers run beside
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    for runner in _beside:
        runner.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for runner in _beside:
        code, waited, lines = runner.finish()
        _finished.append((runner, code, waited, lines))
        if code != 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    time.sleep = _real_sleep


def _waited(item: pytest.Item, when: str):
    before = _slept[0]
    yield
    waited = _slept[0] - before
    _SPENT[tier(item.nodeid)][f"wait_{when}"] += waited
    _MODULES[item.nodeid.split("::", 1)[0]][f"wait_{when}"] += waited


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from _waited(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _waited(item, "call")


def tier(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) < 3 or parts[0] != "tests":
        return "other"
    if parts[1] == "cluster" and len(parts) > 3 and parts[2] in ("real", "kind"):
        return f"cluster/{parts[2]}"
    return parts[1]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SPENT[tier(report.nodeid)][report.when] += report.duration
    _MODULES[report.nodeid.split("::", 1)[0]][report.when] += report.duration
    if report.when == "call":
        _COUNT[tier(report.nodeid)] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    tr = terminalreporter
    for runner, code, waited, lines in _finished:
        tr.section(runner.title)
        for line in lines:
            tr.write_line(line)
        tr.write_line(f"its output: {runner.log}; waited {waited:.0f} s for it after the last test"
                      + ("" if code == 0 else f"; FAILED (exit {code})"), red=code != 0, bold=code != 0)
    if not _SPENT:
        return
    tr.section("where the time went, by tier (seconds)")
    tr.write_line(f"{'tier':<14} {'tests':>6} {'set-up':>8} {'calls':>8} {'teardown':>9} {'total':>8} {'budget':>7}"
                  f"   {'waiting in set-up + calls':>25}")
    total = 0.0
    for name in sorted(_SPENT):
        s = _SPENT[name]
        spent = s["setup"] + s["call"] + s["teardown"]
        total += spent
        budget = BUDGETS.get(name)
        over = budget is not None and spent > budget
        line = (f"{name:<14} {_COUNT[name]:>6} {s['setup']:>8.0f} {s['call']:>8.0f} {s['teardown']:>9.0f} "
                f"{spent:>8.0f} {budget if budget is not None else '-':>7}"
                f"   {s['wait_setup']:>12.0f} + {s['wait_call']:<10.0f}")
        tr.write_line(line + (f"   OVER BUDGET by {spent - budget:.0f} s" if over else ""), red=over, bold=over)
    goal = sum(BUDGETS.values())
    tr.write_line(f"{'all':<14} {sum(_COUNT.values()):>6} {'':>8} {'':>8} {'':>9} {total:>8.0f} {goal:>7}"
                  + (f"   OVER the {goal} s goal" if total > goal else ""), red=total > goal, bold=total > goal)
    slowest = sorted(_MODULES.items(), key=lambda kv: -(kv[1]["setup"] + kv[1]["call"] + kv[1]["teardown"]))
    tr.write_line("")
    tr.write_line(f"the {min(SLOWEST_MODULES, len(slowest))} slowest modules: total = set-up (of which waiting) + calls "
                  f"(of which waiting) + teardown")
    for path, s in slowest[:SLOWEST_MODULES]:
        spent = s["setup"] + s["call"] + s["teardown"]
        tr.write_line(f"  {spent:>6.0f} = {s['setup']:>5.0f} ({s['wait_setup']:>4.0f}) + {s['call']:>5.0f} "
                      f"({s['wait_call']:>4.0f}) + {s['teardown']:>4.0f}   {path}")
