"""The proofs `make test` leaves out (tests marked `full`: the real-engine tier, minutes of real
engines starting and restarting each), run by CI in slices: each landing runs one slice, chosen by
its commit count, so every slice runs within len(SLICES) landings. A unit test
(tests/unit/test_proofs.py) fails when a module with a `full` test is in no slice, so none runs
nowhere.

    python -m tests.proofs --landing N            run landing N's slice (.ci/run: git rev-list --count HEAD)
    python -m tests.proofs --landing N --which    print its name only
    python -m tests.proofs --slice NAME           run the named slice (make proofs SLICE=NAME)

The kind slice runs inside `make e2e-kind` (.ci/run gives that run every test, not only those
without the mark): a second kind cluster start would cost minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIND = "kind"


@dataclass(frozen=True)
class Slice:
    name: str
    proves: str
    # pytest paths, a module or one test of it ("path::test"); their `full` tests run (a module's other
    # tests run in make test)
    modules: tuple[str, ...]
    minutes: int  # on 2 cores, warm (docs/bench/test-time.md says which are measured)
    # The engine environment the slice's engines run (OMNISTAGE_ENGINE_VERSION of hack/real-engine-env.sh,
    # which builds it or finds it current; OMNISTAGE_CPU_VENV then names it). None: the default (0.30).
    engine_version: str | None = None


LIVENESS = "tests/cluster/real/test_engine_liveness.py"
DISRUPTIONS = "tests/cluster/real/test_disruptions.py"
SERVING = ("tests/cluster/real/test_real_engines.py", "tests/cluster/real/test_seed_negative_control.py")

# A slice is at most about 15 minutes where its modules allow (issue 41: CI within 45 minutes warm is
# make test's 20, the kind tier's 10 and one slice), so a module and its negative control are two
# slices, and the disruption runs are split by test (each starts from and ends at two serving).
SLICES = (
    Slice("liveness", "a stalled head engine and a stalled remote replica under a stream lose nothing, "
          "the running gauge reads 0 after, a killed engine heals",
          (LIVENESS,), 15),
    Slice("liveness-control", "with patch engine_liveness off a stall kills the head's engine (the "
          "negative control)",
          ("tests/cluster/real/test_engine_liveness_negative_control.py",), 8),
    Slice("speech", "audio out through an OmniStage and an OmniStagePool, a pool scale-up and scale-down "
          "under a stream, a pool pod killed mid-request",
          ("tests/cluster/real/test_speech_pipeline.py",), 22),
    Slice("disruptions-roll", "a replica template change (two serving throughout) and a replica pod "
          "deleted under a stream lose nothing",
          (f"{DISRUPTIONS}::test_a_replica_template_change_loses_nothing_and_keeps_two_serving",
           f"{DISRUPTIONS}::test_kubectl_delete_pod_of_a_replica_loses_nothing"), 16),
    Slice("disruptions-head", "an engine image change hands over to a new head under a stream and "
          "loses nothing",
          (f"{DISRUPTIONS}::test_an_engine_image_change_hands_over_to_a_new_head_and_loses_nothing",), 12),
    Slice("head-failure", "a spare head takes over a head process kill and the dead head is the next "
          "spare; a head process kill and a head pod deleted cost no replica reload",
          ("tests/cluster/real/test_head_failure.py",), 15),
    Slice("head-failure-control", "with patch reattach off a head process kill rolls every replica (the "
          "negative control)",
          ("tests/cluster/real/test_head_failure_negative_control.py",), 10),
    Slice("serving", "the rendered command serves and reports its live engine, join by kubectl scale, the "
          "seed's sequence and a load over HTTP with no error, a replica SIGKILL mid-request, a scale-down "
          "under load, a standby held warm and joined in seconds; with the plugin's stage-0 fixes off the "
          "seed's errors come back (the negative control)",
          SERVING, 13),
    # The version matrix (issue 42): the serving core and its negative control again, on the next engine.
    Slice("serving-0.32", "on vLLM 0.32.0 / vllm-omni 0.32.0rc1: the serving core as in 'serving' and the "
          "seed's negative control (its misses answer 503)",
          SERVING, 11, engine_version="0.32"),
    Slice("upgrade", "an OmniStage's engine image moved from 0.30 to 0.32 under a stream loses nothing and "
          "the new head reports the version table's outcomes",
          ("tests/cluster/real/test_engine_upgrade.py",), 11, engine_version="0.32"),
    Slice(KIND, "under real kubelets: a replica pod deleted, a node drained, the head container killed "
          "(replicas re-attach), a head engine stall; audio through the pools",
          ("tests/cluster/kind/test_kind.py", "tests/cluster/kind/test_kind_speech.py"), 25),
)


def for_landing(landing: int) -> Slice:
    return SLICES[landing % len(SLICES)]


def by_name(name: str) -> Slice:
    for s in SLICES:
        if s.name == name:
            return s
    raise SystemExit(f"no proof slice {name!r}; the slices: {', '.join(s.name for s in SLICES)}")


def run(s: Slice) -> int:
    if s.name == KIND:
        raise SystemExit("the kind slice runs inside make e2e-kind (PYTEST_ARGS without -m 'not full')")
    print(f"[proofs] slice {s.name!r} (about {s.minutes} min): {s.proves}", flush=True)
    t0 = time.monotonic()
    env = os.environ.copy()
    if s.engine_version:
        print(f"[proofs] the {s.engine_version} engine environment (hack/real-engine-env.sh)", flush=True)
        version_env = {**env, "OMNISTAGE_ENGINE_VERSION": s.engine_version}
        built = subprocess.run(["bash", "hack/real-engine-env.sh"], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True, check=False, env=version_env)
        if built.returncode:
            print(f"[proofs] slice {s.name!r}: its environment failed (exit {built.returncode})", flush=True)
            return built.returncode
        # The script's last line is the environment's python: its venv is the engines' "image".
        env["OMNISTAGE_CPU_VENV"] = str(Path(built.stdout.split()[-1]).parents[1])
        print(f"[proofs] engines from {env['OMNISTAGE_CPU_VENV']}", flush=True)
    code = subprocess.call([sys.executable, "-m", "pytest", "-m", "full", "--durations=10", *s.modules],
                           cwd=ROOT, env=env)
    print(f"[proofs] slice {s.name!r}: exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
    return code


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.proofs")
    pick = ap.add_mutually_exclusive_group(required=True)
    pick.add_argument("--landing", type=int)
    pick.add_argument("--slice")
    ap.add_argument("--which", action="store_true", help="print the slice's name and exit")
    args = ap.parse_args(argv)
    s = by_name(args.slice) if args.slice else for_landing(args.landing)
    if args.which:
        print(s.name)
        return 0
    if args.landing is not None:
        print(f"[proofs] landing {args.landing}: slice {args.landing % len(SLICES) + 1} of {len(SLICES)}; "
              f"every slice runs within {len(SLICES)} landings: {', '.join(x.name for x in SLICES)}",
              flush=True)
    return run(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
