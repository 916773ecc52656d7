"""A minimal external metrics API (`external.metrics.k8s.io/v1beta1`) for the real HPA controller of
the local control plane: the metrics adapter a cluster runs (KEDA's, prometheus-adapter), made of one
function. TEST-ONLY: it serves whatever `value(namespace, metric)` returns, over HTTPS on loopback
with a throw-away self-signed certificate.

The kube-apiserver reaches it as any aggregated API: an APIService names a Service, here of type
ExternalName `localhost` (the aggregator resolves an ExternalName to that host and the APIService's
port: no kube-proxy, no endpoints, nothing leaves 127.0.0.0/8). The HPA controller asks through the
API server, `GET /apis/external.metrics.k8s.io/v1beta1/namespaces/NS/METRIC`, every sync period.
"""

from __future__ import annotations

import datetime
import json
import re
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from omnistage.runtime.probes import send_json

GROUP_VERSION = "external.metrics.k8s.io/v1beta1"
APISERVICE = "v1beta1.external.metrics.k8s.io"
VALUE_PATH = re.compile(r"^/apis/external\.metrics\.k8s\.io/v1beta1/namespaces/([^/]+)/([^/?]+)")
Value = Callable[[str, str], float | None]  # (namespace, metric) -> value; None: no such metric


def _handler(value: Value, asked: list[tuple[str, str, float | None]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict[str, Any]) -> None:
            send_json(self, code, body)

        def do_GET(self) -> None:  # http.server's name
            path = self.path.split("?", 1)[0]
            if path == f"/apis/{GROUP_VERSION}":  # discovery: the aggregator's availability check
                self._send(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION,
                                 "resources": [{"name": "*", "singularName": "", "namespaced": True,
                                                "kind": "ExternalMetricValueList", "verbs": ["get"]}]})
                return
            m = VALUE_PATH.match(path)
            v = value(m.group(1), m.group(2)) if m else None
            if m:
                asked.append((m.group(1), m.group(2), v))
            if v is None:
                self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                 "reason": "NotFound", "message": f"no metric at {path}"})
                return
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            self._send(200, {"kind": "ExternalMetricValueList", "apiVersion": GROUP_VERSION, "metadata": {},
                             "items": [{"metricName": m.group(2), "metricLabels": {}, "timestamp": now,
                                        "value": f"{round(v * 1000)}m"}]})

        def log_message(self, *args: Any) -> None:  # the HPA asks every sync period: no line each time
            pass

    return Handler


def _self_signed(d: Path) -> ssl.SSLContext:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt")], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "tls.crt", d / "tls.key")
    return ctx


@contextmanager
def serving(kubectl: Any, namespace: str, workdir: Path, value: Value) -> Iterator[list[tuple[str, str, float | None]]]:
    """Serves `value` as the cluster's external metrics API while the block runs; yields the list of
    what the API server asked (namespace, metric, value answered). The APIService is cluster-wide:
    one at a time."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(value, asked := []))
    server.socket = _self_signed(workdir).wrap_socket(server.socket, server_side=True)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "external-metrics", "namespace": namespace},
           "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": port}]}}
    api = {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
           "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "insecureSkipTLSVerify": True,
                    "groupPriorityMinimum": 100, "versionPriority": 100,
                    "service": {"namespace": namespace, "name": "external-metrics", "port": port}}}
    try:
        kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [svc, api]}))
        kubectl("wait", "--for=condition=Available", f"apiservice/{APISERVICE}", "--timeout=60s")
        yield asked
    finally:
        kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
        server.shutdown()
        server.server_close()
