"""The supervisor of an OmniStagePool pod: one headless `vllm serve ... --stage-id K` per stage.

  python3 -m omnistage_engine_patches.stages --stage-id 1 --stage-id 2 \\
      -- vllm serve MODEL --omni --headless ...

Stages that share a pod (and its GPUs: the device plugin cannot give one GPU to two pods) run as
one process each, the command after `--` with `--stage-id K` appended. The pod is one unit for the
operator: it joins and leaves the engine per (stage, pod) and replaces the pod when it fails. So
when any stage's process exits, the others are stopped and the supervisor exits with that status
(a stage that died leaves the pod Failed, never half alive). SIGTERM and SIGINT are passed to every
stage, which then drains and exits on its own; after GRACE_SECONDS what is left is killed (the
kubelet's terminationGracePeriodSeconds bounds the whole anyway).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

GRACE_SECONDS = 20.0
POLL_SECONDS = 0.5


def parse(argv: Sequence[str]) -> tuple[list[int], list[str]]:
    """(stage ids, the command) from `--stage-id K ... -- command...`."""
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit(
            "usage: python3 -m omnistage_engine_patches.stages --stage-id K [--stage-id K ...] -- COMMAND..."
        )
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="omnistage_engine_patches.stages")
    ap.add_argument(
        "--stage-id", type=int, action="append", required=True, help="a stage this pod runs (repeat)"
    )
    ids = ap.parse_args(argv[:cut]).stage_id
    command = argv[cut + 1:]
    if not command:
        raise SystemExit("no command after --")
    if len(set(ids)) != len(ids):
        raise SystemExit(f"stage ids repeat: {ids}")
    return ids, command


def stage_command(command: Sequence[str], stage_id: int) -> list[str]:
    return [*command, "--stage-id", str(stage_id)]


def _stop(procs: dict[int, subprocess.Popen], sig: int) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        time.sleep(POLL_SECONDS)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    ids, command = parse(sys.argv[1:] if argv is None else argv)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: stopping.append(signum))
    procs = {k: subprocess.Popen(stage_command(command, k)) for k in ids}
    print(
        f"omnistage stages: started stage {', '.join(f'{k} (pid {p.pid})' for k, p in procs.items())}",
        flush=True,
    )
    while True:
        if stopping:
            print(f"omnistage stages: signal {stopping[0]}: stopping every stage", flush=True)
            _stop(procs, stopping[0])
            return 0
        exited = {k: p.returncode for k, p in procs.items() if p.poll() is not None}
        if exited:
            k, code = next(iter(exited.items()))
            print(f"omnistage stages: stage {k} exited with status {code}; stopping the others", flush=True)
            _stop(procs, signal.SIGTERM)
            return code or 1  # a stage that ended on its own is a failure of the pod, even with status 0
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    sys.exit(main())
