"""The operator's own ServiceAccount, which no engine pod may run as.

A ServiceAccount is a namespace's: an engine pod in the operator's namespace (the namespaced install
watches it) that names the operator's ServiceAccount, or leaves the name unset where the operator runs
as `default`, would act as the operator, with its API token when automountServiceAccountToken: true
or a projected token asks, and with whatever a cloud's workload identity binds to that ServiceAccount
even without one. The rule compares names the API server cannot see (the operator's namespace and
ServiceAccount are its configuration), so the operator alone checks it (InvalidSpec), like the
host-directory allow-list; validation.py runs it beside SPEC_RULES.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import podtemplate as pt
from .security import OPERATOR_SERVICE_ACCOUNT_ENV, operator_namespace, operator_service_account
from .specs import OmniStageSpec

# What a pod without spec.serviceAccountName runs as: the namespace's default ServiceAccount.
DEFAULT_SERVICE_ACCOUNT = "default"
# serviceAccount is the deprecated spelling the API server still reads when serviceAccountName is unset.
SERVICE_ACCOUNT_FIELDS = ("serviceAccountName", "serviceAccount")
FIELD = "spec.template.spec.serviceAccountName"
# The rule as the API reference states it (docs.py); the messages say which case an OmniStage meets.
RULE = (
    "in the operator's own namespace (the namespaced install's), the engine pods must not run as the "
    f"operator's ServiceAccount ({OPERATOR_SERVICE_ACCOUNT_ENV} of the operator; unset: every "
    "ServiceAccount is refused there): with a token or a cloud identity bound to it they would act with "
    "the operator's rights; name a ServiceAccount of your own"
)


def engine_service_account(spec: OmniStageSpec) -> tuple[str, str]:
    """(the template field that names it, the ServiceAccount the engine pods run as)."""
    pod = pt.mapping(spec.template, "spec")
    for field in SERVICE_ACCOUNT_FIELDS:
        if isinstance(pod.get(field), str) and pod[field]:
            return f"spec.template.spec.{field}", pod[field]
    return FIELD, DEFAULT_SERVICE_ACCOUNT


def service_account_problems(
    namespace: str, spec: OmniStageSpec, environ: Mapping[str, str] = os.environ
) -> list[tuple[str, str]]:
    """(field, message) when the engine pods of an OmniStage in `namespace` could run as the operator.
    The operator's namespace and ServiceAccount are its configuration (not pure, read like the
    engine image default)."""
    home = operator_namespace(environ)
    if namespace != home:
        return []
    own = operator_service_account(environ)
    field, name = engine_service_account(spec)
    if own is None:
        return [(field, (
            f"the operator's own ServiceAccount is unknown ({OPERATOR_SERVICE_ACCOUNT_ENV} of the operator "
            f"is unset) and this OmniStage is in the operator's namespace {home}, where its engine pods "
            f"could run as it ({name}): set {OPERATOR_SERVICE_ACCOUNT_ENV} (the install manifests and the "
            "chart set it from the downward API, spec.serviceAccountName), or put the OmniStage in a "
            "namespace the operator does not run in (docs/security.md)"
        ))]
    if name != own:
        return []
    unset = " (unset, the namespace's default)" if name == DEFAULT_SERVICE_ACCOUNT and field == FIELD else ""
    return [(field, (
        f"the engine pods would run as {name}{unset}, the operator's own ServiceAccount in its namespace "
        f"{home}: with a token (automountServiceAccountToken, a projected token) or a cloud identity bound "
        "to it, they would act with the operator's rights (every membership Secret, every pod); name a "
        "ServiceAccount of your own in spec.template.spec.serviceAccountName"
    ))]
