"""Every child of an OmniStage at once, for `omnistage render` and the reconcile loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .common import Target
from .config import render_configmap
from .network import render_api_service, render_master_service, render_network_policy, render_secret
from .pods import render_head_pod, render_replica_pod


@dataclass
class ChildSet:
    configmap: dict[str, Any]
    secret: dict[str, Any]
    api_service: dict[str, Any]
    master_service: dict[str, Any]
    network_policy: dict[str, Any]
    head: dict[str, Any]
    replicas: list[dict[str, Any]] = field(default_factory=list)

    def all(self) -> list[dict[str, Any]]:
        return [self.configmap, self.secret, self.api_service, self.master_service, self.network_policy,
                self.head, *self.replicas]


def render_children(t: Target, token: str, head_ip: str, head_uid: str) -> ChildSet:
    """Replica pods need the head's IP and UID, which exist only once the head pod does; the
    reconcile loop renders them later, `omnistage render` passes placeholders."""
    replicas = [render_replica_pod(t, i, head_ip, head_uid) for i in range(1, t.spec.replicas)] \
        if t.distributed else []
    return ChildSet(
        configmap=render_configmap(t),
        secret=render_secret(t, token),
        api_service=render_api_service(t),
        master_service=render_master_service(t),
        network_policy=render_network_policy(t),
        head=render_head_pod(t),
        replicas=replicas,
    )
