"""Container-runtime stand-in for the local control plane (test and demo tooling only).

kwok is the kubelet of the simulated H200 nodes: it binds pods, marks them Running/Ready and gives
them loopback IPs, but it runs no containers. This process is the missing container runtime for the
engine pods: it watches the pods labelled serving.omnistage.io/component in (engine,pool) and, for
every running pod with a pod IP, starts the matching stand-in process bound to that IP:

  role=head     python -m tests.standin.head --bind-ip <podIP> --http-port <--port> \\
                    --master-port <--omni-master-port> --token-file <token from <name>-membership> \\
                    [--stages N --startup-timeout <--stage-init-timeout>]
  role=replica  python -m tests.standin.replica --master-ip <--omni-master-address> \\
                    --master-port <--omni-master-port> --bind-ip <podIP>
  role=pool     python -m tests.standin.replica --master-ip <--omni-master-address> \\
                    --master-port <--omni-master-port> --bind-ip <podIP> --stage-id K [--stage-id K ...]

A head's N is len(stages) of its deploy config (`--deploy-config`, read from the ConfigMap the pod
mounts there, through the API as the kubelet would): N > 1 starts the multi-stage stand-in head,
which serves nothing (not Ready) until one replica of each of stages 1..N-1 registered and exits 1
after the stage-init timeout. A pool pod (issue 12: `python3 -m omnistage_engine_patches.stages
--stage-id K ... -- vllm serve ... --headless`) gets ONE process for all its stages (the import
cost of vLLM once per pod on a small machine): the stage ids are the `--stage-id` values before
`--`, the master address and port come after it.

Pod deleted (deletionTimestamp set, gone, or replaced under the same name with a new UID) ->
SIGTERM to the process group, SIGKILL after a bound. It also does the kubelet duties kwok
cannot, because kwok knows nothing about the process:

  * a container dies whole: when its main process exits or is killed, every process it started
    (its process group and session, and any process carrying the run's marker variable, one that
    called setsid) is SIGKILLed before the restart, as a container's cgroup goes with it; a stop
    does the same after SIGTERM. Before, a killed head's engine core kept the head's ports and the
    restarted head crash-looped on "Address already in use" (issue 39).
  * restartPolicy: a process that dies while its pod exists is restarted (Always/OnFailure, with
    the kubelet's growing back-off; the restarted head has a new boot id) or its pod is marked
    Failed (Never: replicas), with restartCount / lastState / Ready written like a kubelet does.
  * preStop: a deleted pod's container preStop exec hook runs before SIGTERM (the replica and
    pool pods' hook drains them at the head), bounded by the grace period.
  * readiness: a container with an httpGet readinessProbe is Ready only while the probe answers
    2xx (kwok marks every pod Ready at once, which would make "head Ready" meaningless), and a pod
    with spec.readinessGates (replica and pool pods: the operator's joined condition) is Ready only
    while its containers are and every gate's condition is True, as the kubelet computes it. kwok
    also writes True into every readiness gate at start-up; the runtime takes that back when it
    starts the process, so a replica stays NotReady until its stand-in registered and was joined.
  * liveness: a container with an httpGet livenessProbe is probed once it has started (its readiness
    probe succeeded once, or without one its liveness probe); failureThreshold failures in a row
    (refused, timed out, not 2xx/3xx) -> SIGTERM (the preStop hook is not run), SIGKILL after the
    bound of a stop, and the restart policy above.

`kill(namespace, pod)` (or `python -m tests.standin.runtime kill NS/POD`) SIGKILLs a pod's
process the way an OOM kill would; the restart policy above then applies: the head comes back with
a new boot id, a replica pod turns Failed.

NETWORK RULE (DESIGN.md section 7): only 127.0.0.0/8. Pod IPs and master addresses outside it are
refused (logged and skipped), the API server must be on loopback, probes dial pod IPs only, and
proxy variables are stripped from children so nothing is sent through a proxy.

REAL MODE (`image=EngineImage(...)`, or `--engine-env VENV --model NAME=DIR`: realpod.cpu_engine_image): instead of
a stand-in, each engine pod runs its OWN container command and args with its own environment and
mounts (tests/standin/realpod.py has the mapping: the image is a venv on this machine, spec.model a
local directory). Probes, restart policy and kill are the same; a deleted pod's process gets the
pod's terminationGracePeriodSeconds (capped at REAL_GRACE_CAP) after SIGTERM, and engines run niced.
Cluster DNS for the names engines resolve: every master Service (NAME-master.NS.svc, the serving head
pod's address) is written into this machine's /etc/hosts while the runtime runs (cluster_dns.py).

Usage:
  python -m tests.standin.runtime [--namespace NS|GLOB ...] [--kubeconfig F] [--state-dir D]
  python -m tests.standin.runtime --engine-env ~/.cache/omnistage/venv-cpu --model NAME=DIR ...
  python -m tests.standin.runtime kill NS/POD [--state-dir D]
  with StandinRuntime(namespaces=[ns]) as rt: ...          (pytest fixtures)

Where it lives: kubelet.py (the watch loop's decisions: StandinRuntime), podwatch.py (the pod
watch), containers.py and commands.py (a pod's command line and environment), lifecycle.py and
processes.py (starting, restarting and stopping processes; the fork server is zygote.py), podstatus.py
(probes and the status a kubelet writes). This module is the command line and the public face:
`from tests.standin.runtime import StandinRuntime`.

Product code in operator/ must never import this module.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from tests.standin import realpod
from tests.standin.commands import HEAD_MODULE, REPLICA_MODULE
from tests.standin.kubelet import DEFAULT_STATE_DIR, StandinRuntime
from tests.standin.processes import _is_standin, _killpg, _now

__all__ = ["StandinRuntime", "main"]


def _kill_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.standin.runtime kill",
                                 description="SIGKILL a pod's stand-in process (the running runtime applies the "
                                             "restart policy: the head restarts with a new boot id, a replica "
                                             "pod turns Failed).")
    ap.add_argument("target", help="NAMESPACE/POD")
    ap.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    args = ap.parse_args(argv)
    ns, _, pod = args.target.partition("/")
    path = Path(args.state_dir) / "pids" / f"{ns}_{pod}.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"no stand-in process recorded for {args.target} in {path.parent}", file=sys.stderr)
        return 1
    pid = info["pid"]
    if not _is_standin(pid, info.get("argv")):
        print(f"pid {pid} of {args.target} is not a running stand-in", file=sys.stderr)
        return 1
    _killpg(pid, signal.SIGKILL)
    print(f"[runtime {_now()}] SIGKILL sent to {args.target} pid {pid}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kill"]:
        return _kill_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m tests.standin.runtime", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--namespace", action="append", default=[],
                    help="watch only this namespace (repeatable; globs like 't-*' allowed); default: all")
    ap.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    ap.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="process logs, pid files, token files")
    ap.add_argument("--no-probes", action="store_true", help="leave readiness to kwok (Ready at once)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the stand-in processes")
    ap.add_argument("--engine-env", metavar="VENV",
                    help="real mode: run each engine pod's own command in this environment (the CPU engine "
                         "environment of hack/real-engine-env.sh) instead of a stand-in")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                    help="real mode: serve DIR where a pod names spec.model NAME (repeatable)")
    ap.add_argument("--head-module", default=HEAD_MODULE, help=argparse.SUPPRESS)     # harness self-tests
    ap.add_argument("--replica-module", default=REPLICA_MODULE, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    image = None
    if args.engine_env:
        models = dict(m.split("=", 1) for m in args.model)
        image = realpod.cpu_engine_image(Path(args.engine_env), {k: Path(v) for k, v in models.items()})
    rt = StandinRuntime(kubeconfig=args.kubeconfig, namespaces=args.namespace, state_dir=args.state_dir,
                        python=args.python, probes=not args.no_probes,
                        head_module=args.head_module, replica_module=args.replica_module, image=image)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    rt.start()
    try:
        while not done.wait(1.0):
            if rt.error:
                print(f"[runtime {_now()}] fatal: {rt.error}", flush=True)
                return 1
    finally:
        rt.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
