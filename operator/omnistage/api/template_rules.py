"""The spec.template rows of validation.SPEC_RULES, after field_rules.py's: what the template must not
set, for each its CEL (the API server's check) and the Python that names the offending items (the
operator's), both from template_checks.py, and the message. The template's schema is the API server's
(crd.py); these rules keep what the operator renders the operator's.
"""

from __future__ import annotations

from .. import names
from . import podtemplate as pt
from .owned import OWNED_ENV_NAMES, OWNED_ENV_PREFIX, STANDIN_ENV_PREFIX
from .rule import Rule
from .security import (
    ALLOWED_CAPABILITIES,
    ALLOWED_HOST_PATHS_ENV,
    GPU_RUNTIME_ENV_PREFIX,
    GPU_RUNTIME_VARIABLES,
    GPU_RUNTIME_WHY,
    system_priority_message,
)
from .template_checks import (
    HOST_NAMESPACES,
    MEMBERSHIP_SECRETS,
    PLACEMENT_EXCLUSIVE,
    SHARED_NAMESPACES,
    UNSET_POD_FIELDS,
    absent_or,
    capability_cel,
    capability_items,
    container_secret_cel,
    container_secret_items,
    engine_env_prefix_cel,
    engine_env_prefix_items,
    engine_owned_env_cel,
    engine_owned_env_items,
    engine_owned_field_items,
    engine_owned_fields_cel,
    engine_owned_mount_items,
    escalation_cel,
    escalation_items,
    gpu_env_cel,
    gpu_env_items,
    gpu_request_cel,
    gpu_request_items,
    owned_annotation_items,
    owned_label_items,
    placement_conflict_cel,
    placement_conflict_items,
    port_name_cel,
    port_name_items,
    present,
    product_selector_items,
    set_pod_field_items,
    system_priority_cel,
    system_priority_items,
    token_mount_cel,
    token_mount_items,
    true_pod_field_items,
)
from .template_volumes import (
    HOST_PATH_TYPES_REFUSED,
    PROJECTED_SOURCES,
    VOLUME_SOURCES,
    host_path_type_cel,
    host_path_type_items,
    host_path_volume_items,
    owned_volume_items,
    projected_source_cel,
    projected_source_items,
    secret_volume_cel,
    secret_volume_items,
    volume_source_cel,
    volume_source_items,
)

TEMPLATE_RULES = [
    Rule(
        ".template.metadata.labels",
        absent_or(
            "template.metadata.labels",
            "self.template.metadata.labels.all(k, !(k in ["
            + ", ".join(f"'{k}'" for k in names.OPERATOR_LABELS)
            + f"]) && !k.startsWith('{names.GROUP}/'))",
        ),
        "spec.template.metadata.labels must not set the operator's labels "
        f"({', '.join(names.OPERATOR_LABELS)}, {names.GROUP}/*): the Services, the NetworkPolicy and the "
        "scale selector find the engine pods by them",
        owned_label_items,
    ),
    Rule(
        ".template.metadata.annotations",
        absent_or(
            "template.metadata.annotations",
            f"self.template.metadata.annotations.all(k, !k.startsWith('{names.GROUP}/'))",
        ),
        f"spec.template.metadata.annotations must not set {names.GROUP}/* annotations: they carry the "
        "operator's pod template hash and each replica's head",
        owned_annotation_items,
    ),
    Rule(
        ".template.spec.containers",
        engine_owned_fields_cel(),
        f"spec.template.spec.containers: the engine container (name: {pt.ENGINE_CONTAINER}) must not set "
        + ", ".join(pt.ENGINE_OWNED_FIELDS)
        + ": the operator renders them (use spec.engine.image, "
        "spec.engine.extraArgs, spec.engine.httpPort/masterPort and spec.engine.startupTimeoutSeconds)",
        engine_owned_field_items,
    ),
    Rule(
        ".template.spec.containers",
        engine_owned_env_cel(),
        "spec.template.spec.containers: the engine container's env must not set variables the operator "
        "manages ("
        + ", ".join(OWNED_ENV_NAMES)
        + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): they switch the "
        "engine plugin off or on, set the frontend cache, carry the membership token and the engine's "
        "address",
        engine_owned_env_items,
    ),
    Rule(
        ".template.spec.containers",
        engine_env_prefix_cel(),
        "spec.template.spec.containers: the engine container's envFrom must not use a prefix in the "
        f"operator's namespace ({OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): it "
        "would set the operator's variables; use another prefix",
        engine_env_prefix_items,
    ),
    Rule(
        ".template.spec.containers",
        # No CEL: comparing every mount path with spec.modelVolume.mountPath (a string of any length, with
        # and without a trailing /) is estimated at more than 100x the API server's CEL cost budget, even
        # with volumeMounts bounded (hack/gen-podtemplate-schema.py).
        None,
        "spec.template.spec.containers: the engine container's volumeMounts must not use the operator's "
        f"mount paths ({', '.join(pt.OPERATOR_MOUNT_PATHS)}, spec.modelVolume.mountPath, or below "
        f"{' or '.join(pt.OPERATOR_FILE_DIRS)}): they hold the deploy config, the membership token, the "
        "caches and the model; mount elsewhere",
        engine_owned_mount_items,
    ),
    *(
        Rule(
            f".template.spec.{field}",
            gpu_request_cel(field),
            f"spec.template.spec.{field} must not request the GPU resource (spec.gpu.resource): the operator "
            "sets it on the engine container from spec.gpu.count",
            gpu_request_items(field),
        )
        for field in ("containers", "initContainers")
    ),
    # The security model (docs/security.md), for every container: the engine, sidecars, init containers.
    *(
        rule
        for field in ("containers", "initContainers")
        for rule in (
            Rule(
                f".template.spec.{field}",
                escalation_cel(field),
                f"spec.template.spec.{field}: no container may set securityContext.privileged or "
                "allowPrivilegeEscalation to true: a privileged container is root on the node (every device "
                "and capability), and privilege escalation (setuid binaries, file capabilities) undoes the "
                "engine pods' hardening; remove them",
                escalation_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                capability_cel(field),
                f"spec.template.spec.{field}: securityContext.capabilities.add may hold only "
                f"{' and '.join(ALLOWED_CAPABILITIES)} (pinned memory for GPU and RDMA transfers, NUMA "
                "binding): engine containers drop every capability, and any other (SYS_ADMIN, NET_ADMIN, "
                "SYS_PTRACE...) is a step towards the node",
                capability_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                container_secret_cel(field),
                f"spec.template.spec.{field}: env valueFrom.secretKeyRef and envFrom secretRef must not "
                "refer to "
                + MEMBERSHIP_SECRETS,
                container_secret_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                gpu_env_cel(field),
                f"spec.template.spec.{field}: no container may set {GPU_RUNTIME_VARIABLES}, and every "
                f"envFrom must set a prefix that keeps its keys out of {GPU_RUNTIME_ENV_PREFIX}* (HF_, not N "
                "or NVIDIA_; a ConfigMap's or Secret's keys are out of the operator's sight): "
                + GPU_RUNTIME_WHY,
                gpu_env_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                port_name_cel(field),
                f"spec.template.spec.{field}: ports may not be named "
                f"{', '.join(pt.OPERATOR_PORT_NAMES)}: those are the engine's, and the OmniStage's "
                "NetworkPolicy and Services open and target ports by name, in every container of its pods "
                "(http to every client); name the port otherwise",
                port_name_items(field),
            ),
            Rule(
                f".template.spec.{field}",
                token_mount_cel(field),
                f"spec.template.spec.{field}: only the engine container may mount the operator's volume "
                f"{pt.V_TOKEN}: it holds the OmniStage's membership token, which makes its engines join and "
                "leave",
                token_mount_items(field),
            ),
        )
    ),
    Rule(
        ".template.spec.volumes",
        # The operator's allow-list, which the API server cannot see; a check of each volume's path
        # in CEL (up to 256 volumes) would cost past the API server's budget for the whole schema.
        None,
        "spec.template.spec.volumes may mount only host directories (hostPath) the operator's administrator "
        f"allows ({ALLOWED_HOST_PATHS_ENV} of the operator: `omnistage run --allowed-host-paths`, the chart "
        "value allowedHostPaths; none by default), each a plain absolute path other than / without '.' or "
        "'..' segments or '//': any other node directory (the container runtime's socket, /etc, the "
        "kubelet's files) is a way onto the node; bring the weights with spec.modelVolume (a "
        "PersistentVolumeClaim, or an allowed directory)",
        host_path_volume_items,
    ),
    Rule(
        ".template.spec.volumes",
        host_path_type_cel(),
        f"spec.template.spec.volumes: hostPath.type must not be {', '.join(HOST_PATH_TYPES_REFUSED)}: a "
        "socket (the container runtime's, the kubelet's) or a device node is a way onto the node even "
        "mounted read-only; mount a directory (Directory) or a file (File)",
        host_path_type_items,
    ),
    Rule(
        ".template.spec.volumes",
        volume_source_cel(),
        f"spec.template.spec.volumes may use only the volume sources {', '.join(VOLUME_SOURCES)} (hostPath "
        "where the operator allows it): gitRepo runs git as root on the node (CVE-2024-10220), and the "
        "in-tree plugins (nfs, iscsi, rbd, cephfs, flexVolume, azureFile...) have the node mount a "
        "server the spec names, several with a Secret the kubelet reads for them; use a "
        "PersistentVolumeClaim",
        volume_source_items,
    ),
    Rule(
        ".template.spec.volumes",
        projected_source_cel(),
        f"spec.template.spec.volumes: projected volumes may hold only {', '.join(PROJECTED_SOURCES)} "
        "sources: a serviceAccountToken is an API credential of the pod's ServiceAccount (in the "
        "operator's namespace, possibly the operator's own), a podCertificate an identity of it; engine "
        "pods carry no API credential, and a sidecar that needs one takes a ServiceAccount of its own "
        "with automountServiceAccountToken: true",
        projected_source_items,
    ),
    Rule(
        ".template.spec.volumes",
        secret_volume_cel(),
        "spec.template.spec.volumes (secret, projected, csi.nodePublishSecretRef) must not mount or hand "
        f"the node {MEMBERSHIP_SECRETS}",
        secret_volume_items,
    ),
    Rule(
        ".template.spec.volumes",
        absent_or(
            "template.spec.volumes",
            "self.template.spec.volumes.all(v, !(v.name in ["
            + ", ".join(f"'{v}'" for v in pt.OPERATOR_VOLUMES)
            + "]))",
        ),
        "spec.template.spec.volumes must not use the operator's volume names ("
        + ", ".join(pt.OPERATOR_VOLUMES)
        + "): a volume of the same name would replace the deploy config, /dev/shm, the cache, the membership "
        "token or the model volume; name yours differently",
        owned_volume_items,
    ),
    *(
        Rule(
            f".template.spec.{field}",
            "!(" + present(f"template.spec.{field}") + ")",
            f"spec.template.spec.{field} {why}",
            set_pod_field_items(field),
        )
        for field, why in UNSET_POD_FIELDS.items()
    ),
    *(
        Rule(
            f".template.spec.{field}",
            absent_or(f"template.spec.{field}", f"!self.template.spec.{field}"),
            f"spec.template.spec.{field} must not be true: {why}",
            true_pod_field_items(field),
        )
        for field, why in {**HOST_NAMESPACES, **SHARED_NAMESPACES}.items()
    ),
    Rule(
        ".template.spec.priorityClassName",
        system_priority_cel(),
        system_priority_message("spec.template.spec.priorityClassName"),
        system_priority_items,
    ),
    Rule(
        ".template.spec.nodeSelector",
        absent_or(
            "template.spec.nodeSelector", "!(self.gpu.productLabel in self.template.spec.nodeSelector)"
        ),
        "spec.template.spec.nodeSelector must not set the GPU product label (spec.gpu.productLabel): "
        "use spec.gpu.product",
        product_selector_items,
    ),
    Rule(
        ".placement",
        placement_conflict_cel(),
        "spec.placement and spec.template.spec must not both set "
        + ", ".join(PLACEMENT_EXCLUSIVE.values())
        + ": Kubernetes does not merge these, so the template's would replace the placement's; set each in "
          "one place",
        placement_conflict_items,
    ),
]
