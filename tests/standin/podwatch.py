"""The stand-in runtime's pod watch: a list, then a watch from its resourceVersion (listed again after a
410), one thread per watched namespace (or one for all, with globs), keeping the latest object of every
engine pod it is told to run. A fresh list is the whole truth for its scope. It gives up loudly (the
runtime's `error`) after MAX_WATCH_FAILURES failed reconnects in a row."""

from __future__ import annotations

import fnmatch
from typing import Any

from kubernetes import watch
from kubernetes.client.rest import ApiException

from tests.standin.commands import L_COMPONENT

# Stage-0 pods (head, replicas) and the pods of stages >= 1 (pools).
COMPONENTS = ("engine", "pool")
SELECTOR = f"{L_COMPONENT} in ({','.join(COMPONENTS)})"
WATCH_TIMEOUT = 60          # server-side watch timeout; the watch is simply re-opened afterwards
MAX_WATCH_FAILURES = 30     # consecutive failed (re)connects before the runtime gives up loudly


class PodWatch:
    """The StandinRuntime's part that watches pods (kubelet.py mixes it in)."""

    def _list(self, ns: str) -> tuple[list[dict[str, Any]], str]:
        if ns:
            res = self._watch_api.list_namespaced_pod(ns, label_selector=SELECTOR, _request_timeout=30)
        else:
            res = self._watch_api.list_pod_for_all_namespaces(label_selector=SELECTOR, _request_timeout=30)
        return [self._serialize(p) for p in res.items], res.metadata.resource_version

    def _watch_loop(self, ns: str) -> None:
        failures, rv = 0, None
        while not self._stop.is_set():
            try:
                if rv is None:
                    pods, rv = self._list(ns)
                    self._replace_scope(ns, pods)
                    self._synced.add(ns)
                w = watch.Watch()
                fn = self._watch_api.list_namespaced_pod if ns else self._watch_api.list_pod_for_all_namespaces
                kwargs: dict[str, Any] = {"label_selector": SELECTOR, "resource_version": rv,
                                          "timeout_seconds": WATCH_TIMEOUT, "allow_watch_bookmarks": True,
                                          "_request_timeout": WATCH_TIMEOUT + 10}
                if ns:
                    kwargs["namespace"] = ns
                for ev in w.stream(fn, **kwargs):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        raw = obj if isinstance(obj, dict) else self._serialize(obj)
                        if raw.get("code") == 410:
                            rv = None  # history compacted: list again
                            break
                        raise RuntimeError(f"watch error: {raw}")
                    pod = self._serialize(obj)
                    rv = pod["metadata"].get("resourceVersion") or rv
                    if ev["type"] == "BOOKMARK":
                        continue
                    self._on_pod(ev["type"], pod)
                failures = 0
            except ApiException as err:
                if err.status == 410:
                    rv = None
                    continue
                failures = self._watch_failed(ns, failures, err)
            except Exception as err:  # noqa: BLE001 -- connection reset, API server restarting, ...
                failures = self._watch_failed(ns, failures, err)
            if failures > MAX_WATCH_FAILURES:
                self.error = RuntimeError(f"pod watch in {ns or 'all namespaces'} failed {failures} times in a row")
                self.log(f"giving up: {self.error}")
                return

    def _watch_failed(self, ns: str, failures: int, err: BaseException) -> int:
        failures += 1
        self.log(f"pod watch ({ns or 'all namespaces'}) failed ({failures}/{MAX_WATCH_FAILURES}): "
                 f"{type(err).__name__}: {str(err)[:200]}; reconnecting")
        self._stop.wait(min(5.0, 0.5 * failures))
        return failures

    def _replace_scope(self, ns: str, pods: list[dict[str, Any]]) -> None:
        """A fresh list is the whole truth for its scope: forget pods that disappeared meanwhile."""
        with self._lock:
            fresh = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods
                     if self._wanted(p["metadata"]["namespace"])}
            for key in [k for k in self._pods if (not ns or k[0] == ns) and k not in fresh]:
                del self._pods[key]
            self._pods.update(fresh)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if not self._wanted(key[0]):
            return
        with self._lock:
            if kind == "DELETED":
                if pod["metadata"].get("deletionGracePeriodSeconds") == 0:
                    self.force_deleted.add(pod["metadata"]["uid"])
                cur = self._pods.get(key)
                if cur is not None and cur["metadata"]["uid"] == pod["metadata"]["uid"]:
                    del self._pods[key]
            else:
                self._pods[key] = pod

    def _wanted(self, ns: str) -> bool:
        return not self.namespaces or any(fnmatch.fnmatchcase(ns, n) for n in self.namespaces)
