"""The operator's own ServiceAccount (issue 40 item 5): in the operator's namespace (the namespaced
install's), an OmniStage whose engine pods would run as it is refused, by the operator (the API server
knows neither name), naming the field and what to set instead. Before, `serviceAccountName:
omnistage-operator` with `automountServiceAccountToken: true` was accepted and the pods got the
operator's rights. The operator learns its name from the Deployment's downward API; without it, it
refuses every OmniStage of its own namespace (fail closed)."""

from __future__ import annotations

import pytest
import yaml
from omnistage.api import security
from omnistage.api.validation import InvalidSpec, validate_omnistage

from tests.support.repo import ROOT, SAMPLE

from .test_security import pod

# The install's contract with the operator (manifests/base/deployment.yaml), spelled out so that this
# file also runs, and fails, against an operator that does not read it.
OPERATOR_SERVICE_ACCOUNT_ENV = "OMNISTAGE_SERVICE_ACCOUNT"
OPERATOR_NAMESPACE_ENV = security.OPERATOR_NAMESPACE_ENV
HOME = "tenant-a"  # the namespaced install: the operator runs where the OmniStages are
FIELD = "spec.template.spec.serviceAccountName"


def in_namespace(obj, namespace=HOME):
    obj["metadata"]["namespace"] = namespace
    return obj


@pytest.fixture
def operator_env(monkeypatch):
    monkeypatch.setenv(OPERATOR_NAMESPACE_ENV, HOME)
    monkeypatch.setenv(OPERATOR_SERVICE_ACCOUNT_ENV, "omnistage-operator")
    return monkeypatch


def problems(obj):
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(obj)
    return err.value.problems


@pytest.mark.parametrize("template", [
    {"serviceAccountName": "omnistage-operator", "automountServiceAccountToken": True},
    {"serviceAccountName": "omnistage-operator"},  # a cloud identity bound to it needs no token
    {"serviceAccountName": "omnistage-operator", "automountServiceAccountToken": False},
])
def test_the_operators_service_account_is_refused_in_its_namespace(operator_env, template):
    (found,) = problems(in_namespace(pod(**template)))
    assert found[0] == FIELD
    assert "the operator's own ServiceAccount" in found[1] and "name a ServiceAccount of your own" in found[1]


def test_the_deprecated_spelling_is_read_too(operator_env):
    (found,) = problems(in_namespace(pod(serviceAccount="omnistage-operator")))
    assert found[0] == "spec.template.spec.serviceAccount"


def test_unset_is_the_default_service_account_which_may_be_the_operators(operator_env):
    """The chart with serviceAccount.create=false runs the operator as `default`: then an engine pod that
    names no ServiceAccount would run as the operator."""
    operator_env.setenv(OPERATOR_SERVICE_ACCOUNT_ENV, "default")
    (found,) = problems(in_namespace(pod(automountServiceAccountToken=True)))
    assert found[0] == FIELD and "unset, the namespace's default" in found[1]
    validate_omnistage(in_namespace(pod(serviceAccountName="engine")))


def test_other_service_accounts_and_other_namespaces_pass(operator_env):
    validate_omnistage(in_namespace(pod(serviceAccountName="engine", automountServiceAccountToken=True)))
    validate_omnistage(in_namespace(pod()))  # default, not the operator's
    # Another namespace's omnistage-operator is not the operator (ServiceAccounts are a namespace's).
    validate_omnistage(in_namespace(pod(serviceAccountName="omnistage-operator"), "tenant-b"))


def test_unknown_operator_service_account_fails_closed_in_its_namespace_only(operator_env):
    operator_env.delenv(OPERATOR_SERVICE_ACCOUNT_ENV)
    (found,) = problems(in_namespace(pod(serviceAccountName="engine")))
    assert found[0] == FIELD and OPERATOR_SERVICE_ACCOUNT_ENV in found[1] and "downward API" in found[1]
    validate_omnistage(in_namespace(pod(serviceAccountName="engine"), "tenant-b"))


def test_without_pod_namespace_the_operator_namespace_is_the_installs_default(monkeypatch):
    monkeypatch.delenv(OPERATOR_NAMESPACE_ENV, raising=False)
    monkeypatch.delenv(OPERATOR_SERVICE_ACCOUNT_ENV, raising=False)
    validate_omnistage(in_namespace(pod(serviceAccountName="omnistage-operator"), "serving"))
    assert [f for f, _ in problems(in_namespace(pod(), "omnistage-system"))] == [FIELD]


def test_the_install_tells_the_operator_its_service_account():
    assert getattr(security, "OPERATOR_SERVICE_ACCOUNT_ENV", None) == OPERATOR_SERVICE_ACCOUNT_ENV
    deployment = next(d for d in yaml.safe_load_all((ROOT / "manifests/base/deployment.yaml").read_text())
                      if d["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": OPERATOR_SERVICE_ACCOUNT_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}} in env
    chart = (ROOT / "charts/omnistage-operator/templates/deployment-omnistage-operator.yaml").read_text()
    assert f"name: {OPERATOR_SERVICE_ACCOUNT_ENV}" in chart and "fieldPath: spec.serviceAccountName" in chart


def test_the_sample_passes_in_the_operators_namespace(operator_env):
    validate_omnistage(in_namespace(dict(SAMPLE, metadata=dict(SAMPLE["metadata"]))))
