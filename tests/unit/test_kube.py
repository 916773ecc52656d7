"""kube.request_kind: how the operator's own API request counter (omnistage_operator_api_requests_total)
names a request; the names are the API server's (apiserver_request_total), so the two can be compared."""

from __future__ import annotations

import pytest
from omnistage.runtime.kube import request_kind

H = "https://127.0.0.1:6443"


@pytest.mark.parametrize("method, url, query, want", [
    ("GET", f"{H}/api/v1/namespaces/ns/pods", None, ("list", "pods")),
    ("GET", f"{H}/api/v1/namespaces/ns/pods", [("watch", True), ("resourceVersion", "7")], ("watch", "pods")),
    ("GET", f"{H}/api/v1/namespaces/ns/secrets/tok", None, ("get", "secrets")),
    ("GET", f"{H}/api/v1/pods", [("labelSelector", "a=b")], ("list", "pods")),
    ("GET", f"{H}/api/v1/namespaces", None, ("list", "namespaces")),
    ("GET", f"{H}/api/v1/namespaces/ns", None, ("get", "namespaces")),
    ("PUT", f"{H}/apis/coordination.k8s.io/v1/namespaces/ns/leases/omnistage-operator", None, ("update", "leases")),
    ("GET", f"{H}/apis/coordination.k8s.io/v1/namespaces/ns/leases?watch=true", None, ("watch", "leases")),
    ("POST", f"{H}/apis/coordination.k8s.io/v1/namespaces/ns/leases", None, ("create", "leases")),
    ("PATCH", f"{H}/apis/serving.omnistage.io/v1alpha1/namespaces/ns/omnistages/a/status", None,
     ("patch", "omnistages")),
    ("DELETE", f"{H}/api/v1/namespaces/ns/pods/a-1", None, ("delete", "pods")),
])
def test_request_kind(method, url, query, want):
    assert request_kind(method, url, query) == want
