"""Each replica and pool pod's own membership credential: Secret POD-membership,
holding contract.pod_credential(the master token, the pod's name), which the pod's preStop hook
presents to make itself leave, and nothing else. Written just before the pod (act's CreatePod), and
again before a pod that is still mounting it (someone deleted it: the pod would wait in FailedMount).

The Secret is owned by the OmniStage, as the pod is, and its content follows from the pod's name:
a pod made again under a name gets the same credential, so an existing Secret is kept (the
operator may create and read Secrets, never update or delete them). One the OmniStage does not
own is never mounted: it could be another OmniStage's master token (an OmniStage named like this
pod's name has that Secret name), so the pod is not made until it is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..api.conditions import EventReason
from ..control import pods as pod_rules
from ..names import L_ROLE, REPLICA_ROLES, ROLE_POOL
from ..render.network import render_pod_credential
from ..render.pods import TOKEN_KEY
from . import kube

log = logging.getLogger(__name__)

Emit = Callable[[str, str, str], None]


def needs_credential(pod: dict[str, Any]) -> bool:
    """Replica pods (standbys too) and pool pods mount their own credential; a head the master token."""
    return (pod["metadata"].get("labels") or {}).get(L_ROLE) in (*REPLICA_ROLES, ROLE_POOL)


def ensure(pod: dict[str, Any], master_token: str | None, emit: Emit) -> str | None:
    """Make sure the pod's credential Secret exists before the pod mounts it: None when the pod may
    go ahead, else why not (a problem for status)."""
    if not needs_credential(pod):
        return None
    name = pod["metadata"]["name"]
    if master_token is None:
        return f"pod {name} not created: the operator holds no membership token to derive its credential from"
    want = render_pod_credential(pod, master_token)
    secret_name = want["metadata"]["name"]
    secret, created = kube.create(want)
    if created:
        return None
    ours = {ref.get("uid") for ref in want["metadata"].get("ownerReferences") or []}
    owners = secret["metadata"].get("ownerReferences") or []
    if ours and not ours & {ref.get("uid") for ref in owners}:
        who = ", ".join(f"{ref.get('kind')} {ref.get('name')}" for ref in owners) or "no owner"
        why = (
            f"pod {name} not created: Secret {secret_name}, its membership credential's name, is not this "
            f"OmniStage's (owned by {who}); the operator mounts no Secret it did not write: delete or rename "
            "it"
        )
        emit("Warning", EventReason.CHILD_SYNCED, why)
        return why
    if (secret.get("data") or {}).get(TOKEN_KEY) != want["data"][TOKEN_KEY]:
        # Ours, from an earlier master token (NAME-membership was deleted while the operator was down):
        # the pod starts, but its preStop leave will be refused; the operator's own leave still drains it.
        emit(
            "Warning",
            EventReason.CHILD_SYNCED,
            f"Secret {secret_name} holds a credential from an earlier membership token: pod {name}'s preStop "
            "hook cannot leave the head with it (the operator still drains the pods it deletes). Delete the "
            "Secret; the operator writes it again before the next pod of that name",
        )
    return None


def ensure_mounting(pods: Iterable[dict[str, Any] | None], master_token: str | None, emit: Emit) -> list[str]:
    """The credentials of the replica and pool pods still mounting their volumes (control/pods.mounting):
    re-created when someone deleted them. What could not be done, for status."""
    return [why for pod in pods
            if pod is not None and needs_credential(pod) and pod_rules.mounting(pod)
            and (why := ensure(pod, master_token, emit)) is not None]
