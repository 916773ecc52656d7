"""What a kubelet reports of a pod and kwok cannot, because kwok knows nothing of the process: Ready
and ContainersReady from the container's readiness probe and the pod's readiness gates (kwok says
Ready at once, and writes True into every gate), the liveness probe's kill, a restart's restartCount
and lastState, a Failed pod; and a pod held NotReady while its container cannot start yet. Every
patch names the pod's uid, so an old incarnation's status never lands on its successor."""

from __future__ import annotations

import datetime as dt
import math
import time
import urllib.error
import urllib.request
from typing import Any

from kubernetes.client.rest import ApiException

from tests.standin.commands import L_ROLE, _engine_container
from tests.standin.processes import Proc, _exit_code

PROBE_PERIOD_CAP = 1.0      # probe at least this often (faster than the pods' 5 s: tests wait less)
PROBE_TIMEOUT_CAP = 10.0    # a probe's timeoutSeconds (default 1, as the kubelet's), at most this
GATE_DEBOUNCE = 1.0         # a Ready rewritten for a gate waits this long for the watch before another


class PodStatus:
    """The StandinRuntime's part that probes and patches pod status (kubelet.py mixes it in)."""

    def _not_started_yet(self, pod: dict[str, Any], why: str) -> None:
        """A pod waiting for its container is not Ready, as the kubelet reports it; kwok said Ready
        (readiness gates included) the moment it bound it. Left alone, a PodDisruptionBudget counts it
        healthy and lets a node drain evict a second replica while the first one's replacement waits
        for the old process to stop. Once per pod incarnation."""
        meta = pod["metadata"]
        uid = meta["uid"]
        if uid in self._held_not_ready or not self._runnable(pod):
            return
        self._held_not_ready.add(uid)
        ns, name = meta["namespace"], meta["name"]
        if not self._patch_pod_status(ns, name, uid, {"conditions": _readiness(pod, False, False, reset_gates=True)}):
            return
        self.log(f"notready {pod['metadata'].get('labels', {}).get(L_ROLE, '?'):<7} {ns}/{name} uid={uid[:8]} "
                 f"why=container_not_started:_{why.replace(' ', '_')}")

    def _probe_spec(self, container: dict[str, Any], ip: str,
                    kind: str = "readinessProbe") -> dict[str, Any] | None:
        """The container's httpGet `kind` probe (readinessProbe, livenessProbe), or None."""
        probe = container.get(kind) or {}
        get = probe.get("httpGet")
        if not get:
            return None
        port = get.get("port")
        if isinstance(port, str) and not port.isdigit():
            port = next((cp["containerPort"] for cp in container.get("ports") or [] if cp.get("name") == port), None)
        if port is None:
            return None
        return {"url": f"http://{ip}:{int(port)}{get.get('path') or '/'}",
                "period": min(float(probe.get("periodSeconds") or 10), PROBE_PERIOD_CAP),
                "failure_threshold": int(probe.get("failureThreshold") or 3),
                "timeout": min(float(probe.get("timeoutSeconds") or 1), PROBE_TIMEOUT_CAP)}

    def _probe(self, p: Proc) -> None:
        probe = p.probe
        p.next_probe = time.monotonic() + probe["period"]
        if _probe_ok(probe):
            p.probe_failures, p.started = 0, True
            if p.ready is not True:
                self._patch_ready(p, True, "readiness probe succeeded")
        else:
            p.probe_failures += 1
            if p.ready is True and p.probe_failures >= probe["failure_threshold"]:
                self._patch_ready(p, False, f"readiness probe failed {p.probe_failures} times ({probe['url']})")

    def _live_probe(self, p: Proc, run: int) -> None:
        """One liveness probe of run `run` (p.starts); the kubelet's kill after failureThreshold failures
        in a row, the restart policy then applies to the exit (supervisor step 2)."""
        spec = p.liveness
        ok = _probe_ok(spec)
        if p.starts != run or not p.alive():
            return  # that run is over; its successor probes afresh
        p.next_live = time.monotonic() + spec["period"]
        if ok:
            p.live_failures, p.started = 0, True
            return
        if not p.started:
            return  # still starting up: never killed for that
        p.live_failures += 1
        if p.live_failures >= spec["failure_threshold"]:
            p.next_live = math.inf  # no more probes of this run
            why = f"liveness probe failed {p.live_failures} times ({spec['url']}): restarting"
            self._event("unhealthy", p, why=why)
            self._sigterm(p, "liveness probe failed")

    def _patch_status(self, p: Proc, status: dict[str, Any]) -> bool:
        return self._patch_pod_status(p.namespace, p.pod, p.uid, status)

    def _patch_pod_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> bool:
        """Patch that incarnation's status (uid precondition); False when it is gone or replaced."""
        try:
            self._api.patch_namespaced_pod_status(name, namespace, {"metadata": {"uid": uid}, "status": status},
                                                  _request_timeout=10)
            return True
        except ApiException as err:
            if err.status not in (404, 409, 422):
                self.log(f"status patch of {namespace}/{name} failed: HTTP {err.status}")
            return False

    def _container_statuses(self, p: Proc, pod: dict[str, Any], ready: bool, **change: Any) -> list[dict]:
        out = []
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            cs = dict(cs)
            if cs.get("name") == _engine_container(pod).get("name"):
                cs["ready"] = ready
                cs.update(change)
            out.append(cs)
        return out

    def _fresh_pod(self, p: Proc) -> dict[str, Any] | None:
        with self._lock:
            pod = self._pods.get(p.key)
        return pod if pod and pod["metadata"]["uid"] == p.uid else None

    def _patch_ready(self, p: Proc, ready: bool, why: str, reset_gates: bool = False) -> None:
        """`ready`: the container's readiness. The pod's Ready also needs every readiness gate True
        (reset_gates: write them False first, undoing kwok's start-up True)."""
        pod = self._fresh_pod(p)
        if pod is None:
            return
        pod_ready = ready and (not _gates(pod) or (not reset_gates and _gates_true(pod)))
        # `started` as the kubelet writes it: after the first probe success (of a probed container),
        # kept across readiness flips until a restart (the operator reads a started head: pods.answers).
        started = {"started": p.started} if p.probe else {}
        status = {"conditions": _readiness(pod, pod_ready, ready, reset_gates),
                  "containerStatuses": self._container_statuses(p, pod, ready, **started)}
        if self._patch_status(p, status):
            p.ready = ready
            p.gate_patched_at = time.monotonic()
            self._event("ready" if pod_ready else "notready", p, why=why.replace(" ", "_"))

    def _sync_gates(self, p: Proc, now: float) -> None:
        """A gated pod's Ready follows its gates' conditions (the operator's joined condition)."""
        pod = self._fresh_pod(p)
        if pod is None or not _gates(pod) or now - p.gate_patched_at < GATE_DEBOUNCE:
            return
        containers = p.ready is True if p.probe else True
        want = containers and _gates_true(pod)
        have = any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (pod.get("status") or {}).get("conditions") or [])
        if want != have:
            self._patch_ready(p, containers, "readiness gates " + ("true" if want else "not all true"))

    def _patch_restarted(self, p: Proc, pod: dict[str, Any]) -> None:
        cs = next((c for c in (pod.get("status") or {}).get("containerStatuses") or []), {})
        t = _rfc3339()
        prev_start = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or t
        change = {"restartCount": int(cs.get("restartCount") or 0) + 1, "started": not p.probe,
                  "state": {"running": {"startedAt": t}},
                  "lastState": {"terminated": {"exitCode": p.last_exit or 0,
                                               "reason": "Error" if p.last_exit else "Completed",
                                               "startedAt": prev_start, "finishedAt": t}}}
        status = {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": t},
                                 {"type": "ContainersReady", "status": "False", "lastTransitionTime": t}],
                  "containerStatuses": self._container_statuses(p, pod, False, **change)}
        if self._patch_status(p, status):
            p.ready = False if p.probe else None
        if not p.probe:
            self._patch_ready(p, True, "restarted (no readiness probe)")

    def _patch_failed(self, p: Proc, pod: dict[str, Any], code: int | None) -> None:
        t = _rfc3339()
        exit_code = _exit_code(code)
        reason = "Completed" if exit_code == 0 else "Error"
        cs = next((c for c in (pod.get("status") or {}).get("containerStatuses") or []), {})
        started = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or t
        change = {"started": False, "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                                                             "startedAt": started, "finishedAt": t}}}
        status = {"phase": "Failed" if exit_code else "Succeeded",
                  "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed", "lastTransitionTime": t},
                                 {"type": "ContainersReady", "status": "False", "reason": "PodFailed",
                                  "lastTransitionTime": t}],
                  "containerStatuses": self._container_statuses(p, pod, False, **change)}
        if self._patch_status(p, status):
            self._event("failed", p, phase=status["phase"], exitCode=exit_code)


def _rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_: Any) -> None:
        return None  # the 3xx itself is the answer (a redirect could lead off the pod's IP)


def _probe_ok(spec: dict[str, Any]) -> bool:
    """One httpGet probe: a 2xx/3xx answer within its timeout."""
    # No proxies: the probe dials the pod's loopback IP directly, nothing else.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)
    try:
        with opener.open(spec["url"], timeout=spec["timeout"]) as resp:
            return 200 <= resp.status < 400
    except urllib.error.HTTPError as err:
        err.close()
        return 200 <= err.code < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _gates(pod: dict[str, Any]) -> list[str]:
    """The condition types of the pod's readiness gates."""
    return [g["conditionType"] for g in (pod.get("spec") or {}).get("readinessGates") or [] if g.get("conditionType")]


def _gates_true(pod: dict[str, Any]) -> bool:
    true = {c.get("type") for c in (pod.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}
    return all(g in true for g in _gates(pod))


def _cs(value: bool) -> str:
    return "True" if value else "False"


def _readiness(pod: dict[str, Any], pod_ready: bool, containers_ready: bool,
               reset_gates: bool = False) -> list[dict[str, Any]]:
    """Ready and ContainersReady as the kubelet writes them; reset_gates: every readiness gate False
    too (undoing kwok's start-up True: the gates' owner, the operator, sets them)."""
    t = _rfc3339()
    gates = [{"type": g, "status": "False", "reason": "NotSetYet", "lastTransitionTime": t}
             for g in _gates(pod)] if reset_gates else []
    return [{"type": "Ready", "status": _cs(pod_ready), "lastTransitionTime": t},
            {"type": "ContainersReady", "status": _cs(containers_ready), "lastTransitionTime": t}, *gates]
