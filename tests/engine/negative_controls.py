"""The engine tier's negative controls: each patch switched off in turn, its regression tests must fail.

    python -m tests.engine.negative_controls            every control (make test-negative; make test runs it)
    python -m tests.engine.negative_controls membership  only the named patches' controls
    OMNISTAGE_NEGATIVE_JOBS=1 python -m ...             one control at a time (default: 2 side by side)

A regression test of a patch passes with the patch on (the normal run) and must fail with it off,
or it tests nothing. Each control runs its modules in a pytest process of its own with
OMNISTAGE_DISABLE_PATCHES=<patch> (vLLM loads the plugin once per process, so the switch is per
run) and checks, from the outcomes this module records as that process's plugin:

* exactly as many of its regression tests failed as the control names (`fails`; a test is one when
  its id says "regression" or its docstring starts with "regression:"): one that passes anyway, or a
  regression test added or removed, changes the count and fails the control until it is named again.
  Every test that failed is one, or is listed as a documented failure of the control (`also_fail`):
  nothing else broke;
* the checks that only run with the patch off (`must_pass`, e.g. the registration report's
  `test_without_the_patch_no_member_reports`) passed, so they do not skip in every run.

Regression tests that passed anyway are named (they may guard another patch of the module). Every
patch of contract.PATCHES has a control of its own (tests/unit/test_negative_controls.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUTCOMES_ENV = "OMNISTAGE_NEGATIVE_CONTROL_OUT"


@dataclass(frozen=True)
class Control:
    patch: str
    modules: tuple[str, ...]
    # How many regression tests of `modules` fail with the patch off: a count, so a regression test
    # that stops failing (or one added without its control) is seen, not hidden by the others.
    fails: int
    also_fail: tuple[str, ...] = ()  # substrings of test ids documented to fail too with the patch off
    must_pass: tuple[str, ...] = ()  # substrings of test ids that must pass (not skip) in this run
    notes: str = ""
    slow: bool = False  # its waits take most of the run: started first, so the others fill the other slot


# The guard a module may have that its patch is on in the normal run: off, it fails by definition.
PATCH_IS_APPLIED = "test_the_patch_is_applied"

# From each module's docstring, which says what its control shows; `also_fail` lists what fails too
# without being marked, as found by running the controls (candidates for the "regression" mark).
CONTROLS = (
    # Replica id 0's port is the same with and without the patch: its [0] case passes either way.
    Control("connector_ports", ("test_connector_ports.py",), 5),
    Control("frontend_cache", ("test_frontend_cache.py", "test_engine_report.py"), 22),
    Control("registration_report", ("test_registration_report.py",), 2,
            must_pass=("test_without_the_patch_no_member_reports",)),
    Control("replica_affinity", ("test_replica_affinity.py",), 9,
            also_fail=("test_affinity_never_piles_everything_on_one_replica[control-no-load-bound]",
                       "test_a_steering_error_falls_back_to_upstream")),
    Control("replica_aware_cache", ("test_replica_aware_cache.py",), 5,
            # The in-file controls switch off one part of the patch; with all of it off they fail
            # too. The others test the mirror's bookkeeping, which only the patch has.
            also_fail=("[control-mirror-kept-on-restart]", "[control-miss-not-handled]",
                       "test_replica_joining_mid_sequence", "test_retry_on_another_replica_is_rebuilt_from_full_items",
                       "test_forced_receiver_eviction",
                       "test_concurrent_requests_to_one_replica_keep_mirror_and_receiver_in_step",
                       "test_an_aborted_request_is_forgotten")),
    Control("uuid_scope", ("test_uuid_scope.py",), 8,
            # Without the patch a caller's UUID is not scoped at all, so "scoped like any user UUID" fails.
            also_fail=("test_a_user_uuid_shaped_like_an_engine_key_is_the_users",)),
    # One module, two patches: the frontend's mm cache test guards mm_cache_metrics, the others replica_metrics.
    Control("replica_metrics", ("test_replica_metrics.py",), 7),
    Control("mm_cache_metrics", ("test_replica_metrics.py",), 1),
    # Off: the head does not answer a ping, and the old head's input thread of an engine core never stops.
    Control("reattach", ("test_reattach.py",), 3),
    # Off: upstream detaches a silent replica and shuts the head's own engine down; /live does not judge.
    # The leave test needs a replica listed silent, which only the patch publishes.
    # Slow: each regression test waits out three heartbeat timeouts for a state only the patch reaches.
    Control("engine_liveness", ("test_engine_liveness.py",), 4,
            also_fail=("test_a_leave_detaches_a_silent_replica",), slow=True),
    # Off: the tick of the step that empties the scheduler is throttled to None.
    Control("idle_stats", ("test_idle_stats.py",), 1),
    # Off: vLLM's app has no guard, so every route (/v1/omni/sleep first) answers on the public port.
    Control("public_routes", ("test_public_routes.py",), 4),
    # Off: fresh picks reach draining and unjoined replicas, a late attach stays, no drop is recorded,
    # and a distributed head never stops (30 s, twice: the module's head and the shutdown test's).
    Control("membership", ("test_membership_hooks.py",), 6, slow=True),
)


# ---- the plugin side (in each control's pytest process) -------------------------------------------

def is_regression(item: pytest.Item) -> bool:
    doc = (getattr(getattr(item, "function", None), "__doc__", None) or "").lstrip().lower()
    return "regression" in item.name.lower() or doc.startswith("regression:")


_recorded: dict[str, dict[str, object]] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _recorded[item.nodeid] = {"regression": is_regression(item), "outcome": "not run"}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _recorded.setdefault(report.nodeid, {"regression": False, "outcome": "not run"})
    # The call's outcome; a failed or skipped setup (or a failed teardown) counts too.
    if (report.when == "call" or report.outcome != "passed") and entry["outcome"] in ("not run", "passed"):
        entry["outcome"] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        Path(path).write_text(json.dumps(_recorded))


# ---- the runner ---------------------------------------------------------------------------------

@dataclass
class Verdict:
    control: Control
    seconds: float
    outcomes: dict[str, dict[str, object]]
    problems: list[str] = field(default_factory=list)

    def failed(self, regression: bool) -> list[str]:
        return [n for n, o in self.outcomes.items() if o["outcome"] == "failed" and o["regression"] == regression]


def judge(control: Control, outcomes: dict[str, dict[str, object]], seconds: float) -> Verdict:
    v = Verdict(control, seconds, outcomes)
    if not outcomes:
        v.problems.append("no test ran (collection error? see the output above)")
        return v
    caught = v.failed(regression=True)
    if len(caught) != control.fails:
        passed = [n for n, o in outcomes.items() if o["regression"] and o["outcome"] != "failed"]
        v.problems.append(
            f"{len(caught)} regression tests failed where the control names {control.fails}"
            + (": with the patch off they all pass, so they test nothing" if not caught else "")
            + (f"; not failed: {passed}" if passed else ""))
    documented = (*control.also_fail, PATCH_IS_APPLIED)
    unexpected = [n for n in v.failed(regression=False) if not any(s in n for s in documented)]
    if unexpected:
        v.problems.append(f"failed, and neither a regression test nor documented to: {unexpected}")
    for wanted in control.must_pass:
        got = [o["outcome"] for n, o in outcomes.items() if wanted in n]
        if got != ["passed"] * len(got) or not got:
            v.problems.append(f"{wanted} must pass with the patch off; got {got or 'not collected'}")
    return v


# Controls side by side: their time is mostly waiting (heartbeat timeouts, polls), so two on the
# 2-core machine take about half as long as one after the other.
JOBS = max(1, int(os.environ.get("OMNISTAGE_NEGATIVE_JOBS", "2")))
_print_lock = threading.Lock()


def run(control: Control) -> Verdict:
    """One control's pytest process; its output is printed whole once it ends (never interleaved)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "outcomes.json", Path(tmp) / "output.txt"
        env = {**os.environ, "OMNISTAGE_DISABLE_PATCHES": control.patch, OUTCOMES_ENV: str(out)}
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.engine.negative_controls", "-p", "no:cacheprovider",
                "--no-header", "-rN", *(str(HERE / m) for m in control.modules)]
        header = f"[negative control] OMNISTAGE_DISABLE_PATCHES={control.patch} {' '.join(control.modules)}"
        with _print_lock:
            print(f"{header}: started", flush=True)
        start = time.monotonic()
        with open(log, "w") as f:
            subprocess.run(argv, cwd=ROOT, env=env, check=False, stdout=f, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - start
        with _print_lock:
            print(f"\n{header}: ended after {seconds:.0f} s\n{log.read_text(errors='replace')}", flush=True)
        outcomes = json.loads(out.read_text()) if out.exists() else {}
    return judge(control, outcomes, seconds)


def main(argv: list[str]) -> int:
    wanted = set(argv)
    unknown = wanted - {c.patch for c in CONTROLS}
    if unknown:
        print(f"no negative control for {sorted(unknown)}; known: {[c.patch for c in CONTROLS]}", file=sys.stderr)
        return 2
    start = time.monotonic()
    chosen = [c for c in CONTROLS if not wanted or c.patch in wanted]
    # Longest first: a slow control started last would run alone at the end while a slot stands idle.
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        verdicts = sorted(pool.map(run, sorted(chosen, key=lambda c: not c.slow)), key=lambda v: chosen.index(v.control))
    print(f"\n[negative controls] {len(verdicts)} controls, {JOBS} at a time: {time.monotonic() - start:.0f} s")
    print("\n[negative controls] patch switched off: regression tests failed / passed anyway, other failures")
    for v in verdicts:
        reg = [o for o in v.outcomes.values() if o["regression"]]
        caught = sum(o["outcome"] == "failed" for o in reg)
        print(f"  {'ok  ' if not v.problems else 'FAIL'} {v.control.patch:<22} {caught:>3} / {len(reg) - caught:<3} "
              f"{len(v.failed(regression=False)):>3}  ({v.seconds:.0f} s)")
        for p in v.problems:
            print(f"       {p}")
    return 1 if any(v.problems for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
