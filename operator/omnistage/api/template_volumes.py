"""What spec.template's volumes may be (template_rules.py's volume rows): which volume sources at all,
which host directories and of which type, which projected sources, and none of the operator's
Secrets. Each predicate names the offending items; each CEL is the API server's check of the same.
Read defensively, like template_checks.py: a wrongly typed part is the schema check's to report.
"""

from __future__ import annotations

from typing import Any

from . import podtemplate as pt
from . import security
from .owned import membership_secret, not_membership_secret_cel
from .security import cel_list
from .specs import OmniStageSpec
from .template_checks import absent_or

# ---- volume sources: an allow-list ------------------------------------------------------------------
# What Pod Security `restricted` allows (configMap, csi, downwardAPI, emptyDir, ephemeral,
# persistentVolumeClaim, projected, secret), the host directories the operator's allow-list admits,
# and image volumes (an OCI image read-only: what spec.engine.image already gives). Every other source
# is refused, those Kubernetes adds later too: gitRepo runs git as root on the node (CVE-2024-10220,
# kubelets before 1.29.7/1.30.3), and the in-tree plugins (cephfs, rbd, iscsi, flexVolume, azureFile,
# scaleIO, storageos, nfs, glusterfs...) have the node mount a server of the editor's choosing, several
# with a Secret the kubelet reads for them (a `*-membership` one included). A PersistentVolumeClaim
# reaches the same storage through a PersistentVolume, which the cluster's administrator writes.
VOLUME_SOURCES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "hostPath", "image",
                  "persistentVolumeClaim", "projected", "secret")
# Projected sources: files, no identity. serviceAccountToken is an API credential of the pod's
# ServiceAccount (the engine pods carry none: render/pods.py), podCertificate an identity of it.
PROJECTED_SOURCES = ("clusterTrustBundle", "configMap", "downwardAPI", "secret")


def _refused_keys(path: str, allowed: tuple[str, ...]) -> list[str]:
    """The fields the schema at `path` has beyond `allowed` (and the item's name): what CEL refuses.
    The API server prunes fields its schema does not have, so these are all it can be sent."""
    props = pt.subschema(path)
    props = props["items"] if props.get("type") == "array" else props
    return sorted(set(props["properties"]) - {"name", *allowed})


def volume_source_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].{k}" for i, v in pt.spec_items(spec.template, "volumes") for k in v
            if k != "name" and k not in VOLUME_SOURCES and v[k] is not None]


def volume_source_cel() -> str:
    refused = " && ".join(f"!has(v.{k})" for k in _refused_keys("spec.volumes", VOLUME_SOURCES))
    return absent_or("template.spec.volumes", f"self.template.spec.volumes.all(v, {refused})")


def _projected_sources(v: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    return pt.objects(pt.mapping(v, "projected").get("sources"))


def projected_source_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].projected.sources[{j}].{k}" for i, v in pt.spec_items(spec.template, "volumes")
            for j, src in _projected_sources(v) for k in src if k not in PROJECTED_SOURCES
            and src[k] is not None]


def projected_source_cel() -> str:
    refused = " && ".join(f"!has(s.{k})" for k in _refused_keys("spec.volumes.projected.sources",
                                                                PROJECTED_SOURCES))
    sources = "v.projected.sources"
    return absent_or("template.spec.volumes", "self.template.spec.volumes.all(v, !has(v.projected) || "
                     f"!has({sources}) || {sources}.all(s, {refused}))")


# ---- host directories -----------------------------------------------------------------------------
# A socket (the container runtime's, the kubelet's) or a device node stays a way onto the node when
# mounted read-only: connect() and ioctl() need no writable mount.
HOST_PATH_TYPES_REFUSED = ("Socket", "CharDevice", "BlockDevice")


def host_path_volume_items(spec: OmniStageSpec) -> list[str]:
    """hostPath volumes outside the operator's allow-list (its configuration: not pure, read like the
    engine image default), or not a plain absolute path."""
    allowed = security.operator_allowed_host_paths()

    def refused(path: Any) -> bool:
        return not isinstance(path, str) or not path.startswith("/") or not security.HOST_PATH.holds(path) \
            or not security.host_path_allowed(path, allowed)
    return [f"[{i}].hostPath" for i, v in pt.spec_items(spec.template, "volumes")
            if v.get("hostPath") is not None and refused(pt.mapping(v, "hostPath").get("path"))]


def host_path_type_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].hostPath.type" for i, v in pt.spec_items(spec.template, "volumes")
            if pt.mapping(v, "hostPath").get("type") in HOST_PATH_TYPES_REFUSED]


def host_path_type_cel() -> str:
    return absent_or("template.spec.volumes", "self.template.spec.volumes.all(v, !has(v.hostPath) || "
                     f"!has(v.hostPath.type) || !(v.hostPath.type in {cel_list(HOST_PATH_TYPES_REFUSED)}))")


# ---- the operator's Secrets -------------------------------------------------------------------------

def secret_volume_items(spec: OmniStageSpec) -> list[str]:
    out = []
    for i, v in pt.spec_items(spec.template, "volumes"):
        if membership_secret(pt.mapping(v, "secret").get("secretName")):
            out.append(f"[{i}].secret.secretName")
        if membership_secret(pt.mapping(v, "csi", "nodePublishSecretRef").get("name")):
            out.append(f"[{i}].csi.nodePublishSecretRef.name")
        out += [f"[{i}].projected.sources[{j}].secret.name" for j, src in _projected_sources(v)
                if membership_secret(pt.mapping(src, "secret").get("name"))]
    return out


def secret_volume_cel() -> str:
    sources = "v.projected.sources"
    return absent_or("template.spec.volumes", "self.template.spec.volumes.all(v, ("
                     + not_membership_secret_cel("v.secret", "secretName") + ") && (!has(v.csi) || "
                     + not_membership_secret_cel("v.csi.nodePublishSecretRef") + ") && (!has(v.projected) || "
                     f"!has({sources}) || {sources}.all(s, {not_membership_secret_cel('s.secret')})))")


def owned_volume_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].name" for i, v in pt.spec_items(spec.template, "volumes")
            if v.get("name") in pt.OPERATOR_VOLUMES]
