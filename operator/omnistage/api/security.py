"""What an OmniStage editor may not ask of the operator (docs/security.md): the allow-lists and the
rules about one field's value, and the operator's own configuration of which host directories it may
mount.

Editing an OmniStage makes the operator create pods with its ServiceAccount: the spec must give the
editor no more than creating those pods would, and no more than the security model grants (no host
namespaces, no privilege, no host directories but the ones an administrator allows, none of the
operator's Secrets). The rules about one field are here, as FieldRule (CEL on the field's schema and
the same check in Python, run by pydantic, so OmniStage and OmniStagePool share them); the rules
that compare fields or walk spec.template are rows of validation.SPEC_RULES, whose predicates
(owned.py, template_checks.py) take their lists from here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import names


@dataclass(frozen=True)
class FieldRule:
    """A rule about one field's value, written twice like rule.Rule: as CEL on the field's
    schema (`self` is the value; the API server names the field) and in Python, run by pydantic when a
    spec is parsed (`omnistage render`, the reconcile loop), with one message."""

    cel: str
    message: str
    holds: Callable[[Any], bool]

    def schema(self) -> dict[str, Any]:
        """The field's json_schema_extra: crd.py carries it into the CRD as is."""
        return {"x-kubernetes-validations": [{"rule": self.cel, "message": self.message}]}

    def check(self, value: Any) -> Any:
        """A pydantic AfterValidator (unset optional fields pass)."""
        if value is not None and not self.holds(value):
            raise ValueError(self.message)
        return value


def cel_list(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


# ---- GPU resources --------------------------------------------------------------------------------
# The operator requests spec.gpu.count of spec.gpu.resource and tolerates the taint of that name, so the
# name must be a GPU's: any vendor's <domain>/gpu (nvidia.com/gpu, amd.com/gpu), NVIDIA's time-sliced
# nvidia.com/gpu.shared and its MIG slices (nvidia.com/mig-1g.18gb ... mig-7g.141gb on an H200).
# Refused: cpu, memory, ephemeral-storage, hugepages-*, anything without a '/', and other device
# plugins' resources, which can hand a pod a host device (/dev/kvm, /dev/fuse, a NIC).
# ([.] for a dot: the pattern is also a CEL string literal, where a backslash would need escaping.)
GPU_RESOURCE_PATTERN = ("^([a-z0-9]([-a-z0-9]*[a-z0-9])?[.])+[a-z0-9]([-a-z0-9]*[a-z0-9])?/gpu$"
                        "|^nvidia[.]com/(gpu[.]shared|mig-[0-9]+g[.][0-9]+gb)$")
# A qualified name: a DNS-subdomain prefix (253), '/', a name (63). Bounds the CEL regex's cost.
MAX_RESOURCE_NAME_LENGTH = 317
GPU_RESOURCE = FieldRule(
    f"self.matches('{GPU_RESOURCE_PATTERN}')",
    "spec.gpu.resource must name a GPU: DOMAIN/gpu of a GPU vendor (nvidia.com/gpu, amd.com/gpu), "
    "nvidia.com/gpu.shared or an NVIDIA MIG slice (nvidia.com/mig-3g.71gb); the operator requests "
    "spec.gpu.count of it and tolerates its taint, so any other resource (cpu, memory, ephemeral-storage, "
    "hugepages-*, a device plugin's host device) is refused",
    lambda v: re.search(GPU_RESOURCE_PATTERN, v) is not None,
)

# ---- priority classes -----------------------------------------------------------------------------
# Kubernetes' own classes (no other PriorityClass may be named system-*): a pod with one preempts
# the node's agents and every tenant's pods and is evicted last.
SYSTEM_PRIORITY_CLASSES = ("system-node-critical", "system-cluster-critical")


def system_priority_message(field: str) -> str:
    return (
        f"{field} must not be {' or '.join(SYSTEM_PRIORITY_CLASSES)}: those classes keep the cluster's own "
        "components running, and an engine pod with one would preempt them and other tenants' pods; "
        "use a PriorityClass of your own"
    )


PLACEMENT_PRIORITY = FieldRule(
    f"!(self in {cel_list(SYSTEM_PRIORITY_CLASSES)})",
    system_priority_message("spec.placement.priorityClassName"),
    lambda v: v not in SYSTEM_PRIORITY_CLASSES,
)

# ---- capabilities ---------------------------------------------------------------------------------
# Engine containers drop every capability (render/pods.py). What vLLM may need back, and nothing else:
# IPC_LOCK to pin host memory beyond RLIMIT_MEMLOCK (pinned buffers for GPU transfers, RDMA memory
# registration: spec.transport.protocol rdma), SYS_NICE to bind threads and memory to NUMA nodes.
# Any other (SYS_ADMIN, NET_ADMIN, SYS_PTRACE, ...) is a step towards the node.
ALLOWED_CAPABILITIES = ("IPC_LOCK", "SYS_NICE")

# ---- the GPU fence ---------------------------------------------------------------------------------
# The NVIDIA container toolkit reads its switches from a container's environment as the runtime creates
# it: NVIDIA_VISIBLE_DEVICES (which GPUs the container gets: `all` is every GPU of the node, other
# tenants' included), NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_*, NVIDIA_MIG_*... The device plugin
# decides a pod's GPUs; a spec may set none of these (any name with the prefix), in env or through an
# envFrom whose prefix could spell one. What an image's own ENV sets is out of the operator's sight:
# the node's toolkit must ignore the variable (docs/security.md, "The GPU fence").
GPU_RUNTIME_ENV_PREFIX = "NVIDIA_"
GPU_RUNTIME_VARIABLES = (f"the GPU runtime's variables ({GPU_RUNTIME_ENV_PREFIX}*: NVIDIA_VISIBLE_DEVICES, "
                         "NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_*...)")
GPU_RUNTIME_WHY = ("where the node's NVIDIA runtime honours them, NVIDIA_VISIBLE_DEVICES=all gives the pod "
                   "every GPU of the node, other tenants' included; remove them (the device plugin gives the "
                   "pod its GPUs: spec.gpu.count)")


def gpu_runtime_env(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(GPU_RUNTIME_ENV_PREFIX)


def gpu_runtime_env_cel(name: str) -> str:
    """CEL: the variable name `name` is not the GPU runtime's."""
    return f"!{name}.startsWith('{GPU_RUNTIME_ENV_PREFIX}')"


def gpu_runtime_prefix_fenced(prefix: Any) -> bool:
    """An envFrom prefix no key can complete into the GPU runtime's namespace: set, not a beginning of
    NVIDIA_ (N, NV... with the key IDIA_VISIBLE_DEVICES) and not inside it. The keys of a ConfigMap or
    Secret are out of the operator's sight, so without a prefix any of them could be one."""
    return isinstance(prefix, str) and not GPU_RUNTIME_ENV_PREFIX.startswith(prefix) \
        and not prefix.startswith(GPU_RUNTIME_ENV_PREFIX)


def gpu_runtime_prefix_cel(source: str) -> str:
    """CEL: the envFrom entry `source` has a prefix gpu_runtime_prefix_fenced accepts. The beginnings
    of NVIDIA_ are listed: 'NVIDIA_'.startsWith(prefix) would cost the API server the prefix's length,
    which has no bound, and put the rule past its CEL budget."""
    beginnings = [GPU_RUNTIME_ENV_PREFIX[:n] for n in range(len(GPU_RUNTIME_ENV_PREFIX))]
    return (f"has({source}.prefix) && !({source}.prefix in {cel_list(beginnings)}) && "
            f"!{source}.prefix.startsWith('{GPU_RUNTIME_ENV_PREFIX}')")


# ---- the operator's Secrets -----------------------------------------------------------------------
# The operator writes one Secret per OmniStage, NAME-membership (render/network.py: the membership
# token, which can make any engine of that OmniStage join or leave). A spec may not read a Secret of
# that form, another OmniStage's included; other Secrets of the namespace stay the editor's.
MEMBERSHIP_SECRET_SUFFIX = f"-{names.MEMBERSHIP_SECRET}"

# ---- argv -----------------------------------------------------------------------------------------
# Kubernetes replaces $(VAR) in a container's command and args with the variable's value (Secrets'
# included), and $$( escapes it; the operator builds the engine's argv, so none may hide there.
ARGV_EXPANSION = "$("
# spec.model is `vllm serve`'s first argument: a Hugging Face id (Qwen/Qwen3-Omni-30B-A3B-Instruct) or a
# path (/models/...). No leading '-' (it would be a flag past the operator's), no '$' (an expansion), no
# whitespace or control characters (C0, DEL, C1, no-break space).
MODEL_PATTERN = r"^[^-$\x00-\x20\x7f-\xa0][^$\x00-\x20\x7f-\xa0]*$"

# ---- host directories -----------------------------------------------------------------------------
# spec.modelVolume.hostPath mounts a node directory (read-only) into every engine pod. Which ones is the
# cluster administrator's choice: the operator's configuration lists the allowed directories
# (`omnistage run --allowed-host-paths`, else this variable, set by the install manifests and the chart's
# allowedHostPaths), comma-separated absolute prefixes; none by default. The API server cannot know the
# list, so it refuses only what is never allowed (HOST_PATH below) and the operator the rest (InvalidSpec).
ALLOWED_HOST_PATHS_ENV = "OMNISTAGE_ALLOWED_HOST_PATHS"
MAX_PATH_LENGTH = 4096  # PATH_MAX; bounds the CEL rule's cost
# A '.' or '..' segment: such a path would name another directory than its prefix says.
_DOT_SEGMENT = r"(^|/)[.][.]?(/|$)"
HOST_PATH = FieldRule(
    f"self != '/' && !self.contains('//') && !self.matches('{_DOT_SEGMENT}')",
    "spec.modelVolume.hostPath.path must be an absolute directory other than /, without '.' or '..' "
    "segments or '//': the operator mounts only host directories its administrator allows "
    f"({ALLOWED_HOST_PATHS_ENV}), and a path must say plainly which one it is",
    lambda v: v != "/" and "//" not in v and re.search(_DOT_SEGMENT, v) is None,
)


def parse_allowed_host_paths(text: str) -> tuple[str, ...]:
    """The allow-list from its comma-separated form; ValueError for an entry that is not a plain
    absolute directory (the operator refuses to start with it)."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if not entry.startswith("/") or not (entry == "/" or HOST_PATH.holds(entry)):
            raise ValueError(
                f"{ALLOWED_HOST_PATHS_ENV}: {entry!r} is not an absolute directory without '.' or '..' "
                "segments or '//'"
            )
        out.append(entry if entry == "/" else entry.rstrip("/"))
    return tuple(out)


def operator_allowed_host_paths(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The host directories (prefixes) the operator may mount as spec.modelVolume.hostPath."""
    return parse_allowed_host_paths(environ.get(ALLOWED_HOST_PATHS_ENV) or "")


def host_path_allowed(path: str, allowed: tuple[str, ...]) -> bool:
    path = path.rstrip("/") or "/"
    return any(p == "/" or path == p or path.startswith(p + "/") for p in allowed)


# ---- the operator's namespace ---------------------------------------------------------------------
# The one namespace besides an OmniStage's own pods whose pods the NetworkPolicy lets reach the head's
# membership port: where the operator runs (its Deployment's downward API, POD_NAMESPACE), else the
# install's default. A namespace the operator does not run in would cut it off its heads only where a
# NetworkPolicy is enforced: the Deployment always sets the variable.
OPERATOR_NAMESPACE_ENV = "POD_NAMESPACE"
DEFAULT_OPERATOR_NAMESPACE = "omnistage-system"


def operator_namespace(environ: Mapping[str, str] = os.environ) -> str:
    return (environ.get(OPERATOR_NAMESPACE_ENV) or "").strip() or DEFAULT_OPERATOR_NAMESPACE


# ---- the operator's ServiceAccount ----------------------------------------------------------------
# Its name, from the Deployment's downward API (spec.serviceAccountName): the install manifests and the
# chart set it, so it follows the chart's serviceAccount.name and fullname. No engine pod may run as it
# (api/service_account.py); unset, the operator cannot tell it from another ServiceAccount of its
# namespace, and refuses them all there.
OPERATOR_SERVICE_ACCOUNT_ENV = "OMNISTAGE_SERVICE_ACCOUNT"


def operator_service_account(environ: Mapping[str, str] = os.environ) -> str | None:
    return (environ.get(OPERATOR_SERVICE_ACCOUNT_ENV) or "").strip() or None
