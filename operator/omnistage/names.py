"""Every name the operator writes on objects, once: labels, annotations, roles, components and its
own name. Renderers write them, the plan and the informer read them, validation refuses them in a
user's pod template; all import them from here. Imports nothing, so every layer may use it."""

from __future__ import annotations

GROUP = "serving.omnistage.io"  # the API group; also the prefix of every operator label and annotation

# The operator's own name: managed-by label value, server-side-apply field manager, Event source and
# leader-election Lease. One spelling, so a selector on managed-by finds what the field manager wrote.
OPERATOR = "omnistage-operator"
MANAGED_BY = FIELD_MANAGER = EVENT_SOURCE = LEASE_NAME = OPERATOR
APP_NAME = "omnistage"  # the app.kubernetes.io/name value

# ---- labels ----------------------------------------------------------------------------------------
L_NAME = "app.kubernetes.io/name"
L_INSTANCE = "app.kubernetes.io/instance"
L_MANAGED_BY = "app.kubernetes.io/managed-by"
# Every label and annotation under GROUP/ is the operator's too (selectors, hashes, head UID...).
OPERATOR_LABELS = (L_NAME, L_INSTANCE, L_MANAGED_BY)
L_OMNISTAGE = f"{GROUP}/omnistage"
L_COMPONENT = f"{GROUP}/component"   # COMPONENT_ENGINE or COMPONENT_POOL
L_ROLE = f"{GROUP}/role"             # one of HEAD_POD_ROLES, REPLICA_ROLES or ROLE_POOL
L_POOL = f"{GROUP}/pool"             # the OmniStagePool of a pool pod

# ---- annotations -----------------------------------------------------------------------------------
A_TEMPLATE_HASH = f"{GROUP}/template-hash"
A_CONFIG_HASH = f"{GROUP}/config-hash"
A_EFFECTIVE_CACHE_MODE = f"{GROUP}/effective-cache-mode"  # on the ConfigMap
A_HEAD_UID = f"{GROUP}/head-uid"
# The head container's restartCount when a replica or pool pod was made: a higher count now means the
# engine it registered with is gone (replicas never register again). Read from the pods, never from
# status, which an OmniStage editor may write.
A_HEAD_RESTARTS = f"{GROUP}/head-restarts"
# The `reattach` patch outcome a replica's engine reported (control/reattach.py): "applied" means it
# outlives a restart of its head's engine and registers with the new one, so it is not rolled.
A_REATTACH = f"{GROUP}/reattach"
A_REPLICA_INDEX = f"{GROUP}/replica-index"
A_STAGE_IDS = f"{GROUP}/stage-ids"      # a pool pod's stages ("1,2"): read even after its pool is gone
A_LEAVING = f"{GROUP}/leaving"          # a retirement decided (value: its reason); survives a restart
# On a head pod that took over from a dead head (control/spare.py): when. Its replicas re-attach from
# then on (control/reattach.py measures their bound from it, not from the pod's Ready).
A_SERVING_SINCE = f"{GROUP}/serving-since"

# ---- children ---------------------------------------------------------------------------------------
# The Secret holding an OmniStage's membership token is NAME-membership (render/network.py). Validation
# refuses a spec that reads any Secret named *-membership (api/security.py).
MEMBERSHIP_SECRET = "membership"

# ---- pod conditions -------------------------------------------------------------------------------
# The readiness gate of replica and pool pods (spec.readinessGates): True while the head routes to
# every replica the pod runs. The operator sets it when the head acknowledged the join and clears it
# when the pod leaves, so such a pod is Ready (and counts in readyReplicas, Endpoints, a
# PodDisruptionBudget) only while it serves, not from the moment its container starts.
C_JOINED = f"{GROUP}/joined"

# ---- roles and components --------------------------------------------------------------------------
ROLE_HEAD = "head"  # the head the Services select: the one serving
# A head change without an outage (control/headswap.py) runs a successor head beside the serving one.
# The role label is what moves the Services: a successor is ROLE_NEXT_HEAD until it serves, then
# ROLE_HEAD, while the head it replaces, its predecessor, turns ROLE_OLD_HEAD (out of the Services)
# and drains.
ROLE_NEXT_HEAD = "next-head"
ROLE_OLD_HEAD = "old-head"
HEAD_ROLES = (ROLE_HEAD, ROLE_NEXT_HEAD, ROLE_OLD_HEAD)
# A warm spare head (spec.head.standby, control/spare.py): loaded, outside the Services, serving
# nothing; the Services move to it when the serving head's engine dies. Not one of HEAD_ROLES: no head
# change involves it (it is deleted while one runs, and made again from the new template after).
ROLE_SPARE_HEAD = "spare-head"
HEAD_POD_ROLES = (*HEAD_ROLES, ROLE_SPARE_HEAD)  # every role a head pod's label may carry
ROLE_REPLICA = "replica"
# A replica or pool pod kept unjoined (spec.standby of the OmniStage or the OmniStagePool,
# control/standby.py): outside the PodDisruptionBudget and the scale selector. Like a head's, its role
# label is state: a scale-up turns it ROLE_REPLICA (ROLE_POOL for a pool's) and joins it.
ROLE_STANDBY = "standby"
REPLICA_ROLES = (ROLE_REPLICA, ROLE_STANDBY)
ROLE_POOL = "pool"
# Stage-0 pods (head and replicas: what the OmniStage's scale selector counts) and the pods of the
# OmniStagePools (stages >= 1, counted by each pool's own selector).
COMPONENT_ENGINE = "engine"
COMPONENT_POOL = "pool"
ENGINE_COMPONENTS = (COMPONENT_ENGINE, COMPONENT_POOL)
