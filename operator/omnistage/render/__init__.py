"""Pure rendering of an OmniStage's children: no I/O, the same input gives the same output."""

from .children import ChildSet, render_children
from .common import Target, config_hash, labels, selector
from .config import render_configmap, render_deploy_config
from .network import (
    render_api_service,
    render_disruption_budget,
    render_master_service,
    render_network_policy,
    render_secret,
)
from .pods import render_head_pod, render_replica_pod
from .target import target_from

__all__ = [
    "ChildSet",
    "Target",
    "config_hash",
    "labels",
    "render_api_service",
    "render_children",
    "render_configmap",
    "render_deploy_config",
    "render_disruption_budget",
    "render_head_pod",
    "render_master_service",
    "render_network_policy",
    "render_replica_pod",
    "render_secret",
    "selector",
    "target_from",
]
