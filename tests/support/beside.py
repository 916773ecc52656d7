"""A run of its own beside make test's pytest run: a command in a process of its own, its
output in a log, started when the run reaches it and waited for at the run's end. Two run so:

* the unit tier, and the connector, engine and stand-in tiers one after the other (in the order they
  had in the run: the engine tier's conftest sets the environment before anything imports vLLM), from
  the run's start: none needs the cluster, and the stand-in cluster tier, which is then the run's own,
  leaves the two cores 30-45% idle (its stand-ins wait on the operator and the API server). The unit
  tier is CPU work only; the others mostly wait on processes they start (the stand-in tier 68 s of its
  78 s of calls, the connector tier 43 s of its 44 s of set-up, the engine tier 138 s of its 302 s);
* the engine tier's negative controls (tests/engine/negative_controls.py), from the run's start too:
  they mostly wait on heartbeat timeouts and polls.

tests/conftest.py starts them, prints the part of each log from `marker` on (its table) and fails the
run when one failed. Measured side by side against one after the other: docs/bench/test-time.md.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Beside:
    def __init__(self, title: str, argv: list[str], log: Path, marker: str):
        self.title, self.argv, self.log, self.marker = title, argv, log, marker
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, *self.argv], cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT)

    def finish(self) -> tuple[int, float, list[str]]:
        """Exit code, seconds waited for it after the run's own tests, and the lines to print: the log
        from `marker` on, and its last 40 lines when it failed or printed no marker."""
        if self.proc is None:
            self.start()  # the run never reached the point it starts at (a selection): it still runs
        t0 = time.monotonic()
        code = self.proc.wait()
        text = self.log.read_text(errors="replace")
        at = text.rfind(self.marker)
        lines = text[at:].splitlines() if at >= 0 else []
        if code != 0 or not lines:
            lines = text.splitlines()[-40:]
        return code, time.monotonic() - t0, lines


def negative_controls(log: Path) -> Beside:
    return Beside("the negative controls, run beside the tiers from the run's start",
                  ["-m", "tests.engine.negative_controls"], log, "[negative controls]")


#: The tiers that run beside make test's own run, from its start (the main run does not collect them):
#: the unit tier in a process of its own, the others in one.
UNIT = ("unit",)
ENGINE_TIERS = ("connector", "engine", "standin")
TIERS_BESIDE = UNIT + ENGINE_TIERS


def _pytest(tiers: tuple[str, ...]) -> list[str]:
    return ["-m", "pytest", *(f"tests/{t}" for t in tiers), "-q", "-p", "no:cacheprovider", "-m", "not full"]


def unit_tier(log: Path) -> Beside:
    return Beside("the unit tier, run beside the other tiers from the run's start", _pytest(UNIT), log,
                  "where the time went, by tier")


def engine_tiers(log: Path) -> Beside:
    return Beside(f"the {', '.join(ENGINE_TIERS)} tiers, run beside the other tiers from the run's start",
                  _pytest(ENGINE_TIERS), log, "where the time went, by tier")
