"""The HTTP reads of tests/support/kube_rest.py against kubectl itself, on the local API server: every
poll of the cluster tiers goes through them (Kubectl.json, Kubectl.exists), so what they return must be
what `kubectl get -o json` prints, and a missing object must fail the way kubectl's does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support import kube_rest
from tests.support.kubectl import Kubectl, KubectlError

pytestmark = pytest.mark.usefixtures("omnistage_crd")


def _names(listing: dict[str, Any]) -> list[tuple[str, str, str]]:
    return sorted((i["apiVersion"], i["kind"], i["metadata"]["name"]) for i in listing["items"])


def test_reads_answer_what_kubectl_prints(kubectl: Kubectl, namespace: str) -> None:
    kubectl("create", "configmap", "one", "-n", namespace, "--from-literal=a=1")
    kubectl("create", "configmap", "two", "-n", namespace, "--from-literal=a=2")
    kubectl("label", "configmap", "two", "-n", namespace, "pick=me")
    queries = [
        ("get", "configmap", "-n", namespace),
        ("get", "cm", "-n", namespace, "-l", "pick=me"),
        ("get", "configmaps", "one", "-n", namespace),
        ("get", "configmap/two", f"--namespace={namespace}"),
        ("get", "namespace", namespace),
        ("get", "omnistage", "-n", namespace),
        ("get", "omnistages.serving.omnistage.io", "-n", namespace),
        ("get", "crd", "omnistages.serving.omnistage.io"),
        ("get", "serviceaccount", "-n", namespace, "--field-selector", "metadata.name=default"),
    ]
    for q in queries:
        fast = kube_rest.get(kubectl.kubeconfig, q, timeout=30)
        assert fast is not None, f"{q} was left to kubectl"
        slow = json.loads(kubectl(*q, "-o", "json").stdout)
        if slow.get("kind") == "List":
            assert fast["kind"] == "List" and _names(fast) == _names(slow), q
        else:
            assert (fast["kind"], fast["metadata"]["uid"]) == (slow["kind"], slow["metadata"]["uid"]), q
            assert fast.get("data") == slow.get("data"), q
    assert [i["metadata"]["name"] for i in kubectl.json("get", "cm", "-n", namespace, "-l", "pick=me")["items"]] \
        == ["two"]


def test_a_missing_object_fails_as_kubectl_s_does(kubectl: Kubectl, namespace: str) -> None:
    with pytest.raises(KubectlError) as fast:
        kubectl.json("get", "omnistage", "nowhere", "-n", namespace)
    with pytest.raises(KubectlError) as slow:
        kubectl("get", "omnistage", "nowhere", "-n", namespace, "-o", "json")
    assert fast.value.stderr.strip() == slow.value.stderr.strip()
    assert not kubectl.exists("configmap", "nowhere", "-n", namespace)
    assert kubectl.exists("namespace", namespace)


def test_what_it_does_not_answer_is_left_to_kubectl(kubectl: Kubectl, namespace: str) -> None:
    for q in (("get", "pods", "-n", namespace, "-o", "wide"), ("get", "pods", "a", "b", "-n", namespace),
              ("get", "pods"), ("get", "nosuchkind", "-n", namespace), ("apply", "-f", "x")):
        assert kube_rest.get(kubectl.kubeconfig, q, timeout=30) is None, q
