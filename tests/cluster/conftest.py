"""Cluster tier: a real Kubernetes API server for every test under tests/cluster.

By default the session starts the local control plane (hack/cluster-up.sh: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok with simulated H200 nodes, all on 127.0.0.1) and
stops it at the end. Environment:

  OMNISTAGE_USE_EXISTING_CLUSTER=1  use the cluster KUBECONFIG points at (kind, a GPU cluster)
  OMNISTAGE_KEEP_CLUSTER=1          leave the local cluster running after the session
  OMNISTAGE_CLUSTER_DIR             state dir of the local cluster (default /tmp/omnistage-cluster)
  OMNISTAGE_KUBECTL                 kubectl binary to use instead of the one built with the cluster

A local cluster that was already running when the session began is reused; pytest sessions
sharing it stop it only when the last one leaves, and never stop one started by `make cluster-up`.
Fixtures for later tiers: `kubeconfig`, `kubectl`, `omnistage_crd`, `namespace`, `wait_for`,
`local_cluster`, `helm`, `kustomize`, `operator_identity` (the operator's own ServiceAccount from
manifests/ with a TokenRequest token: the identity every operator process of the tier runs under),
`third_party_crds`.

  OMNISTAGE_HELM                    helm binary to use instead of the one built with the cluster
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.standin.harness import TESTS_PROBE_HEADS_EVERY, OperatorProcess
from tests.standin.kubelet import warm_fork_server
from tests.standin.runtime import StandinRuntime
from tests.support.cluster import OPERATOR_SA, container_env, create_test_namespace
from tests.support.kubectl import Kubectl, cached_binary, k8s_bin_dir
from tests.support.waits import wait_for as _wait_for

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
HACK = ROOT / "hack"
CRD_FILE = ROOT / "crds" / "omnistage.serving.omnistage.io.yaml"
CRD_NAME = "omnistages.serving.omnistage.io"
POOL_CRD_NAME = "omnistagepools.serving.omnistage.io"
MANIFESTS = ROOT / "manifests"
# The namespace the install manifests use (manifests/base).
MANIFEST_NAMESPACE = "omnistage-system"

USE_EXISTING = os.environ.get("OMNISTAGE_USE_EXISTING_CLUSTER") == "1"
KEEP = os.environ.get("OMNISTAGE_KEEP_CLUSTER") == "1"
CLUSTER_DIR = Path(os.environ.get("OMNISTAGE_CLUSTER_DIR", "/tmp/omnistage-cluster"))

# Bounds of the session-level steps. A cold binary build runs before any test (see
# pytest_collection_finish), so cluster start-up itself is seconds to a minute.
BUILD_TIMEOUT = 90 * 60
CLUSTER_UP_TIMEOUT = 10 * 60
CLUSTER_DOWN_TIMEOUT = 2 * 60


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)


def _uncaptured(config: pytest.Config) -> contextlib.AbstractContextManager[Any]:
    """Output capture off: session-level progress reaches the terminal as it happens."""
    capman = config.pluginmanager.getplugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()


def _live(config: pytest.Config, cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a long hack/ script so that its progress lines reach the terminal."""
    with _uncaptured(config):
        print(f"\n[cluster] $ {' '.join(cmd)}", flush=True)
        return subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, cwd=ROOT, check=False, **kw)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build (or find cached) Kubernetes binaries before the first cluster test starts.

    A cold build takes about ten minutes on two cores, beyond the per-test timeout, and
    pytest-timeout counts fixture set-up against the first test; here no timeout applies.
    """
    if USE_EXISTING or os.environ.get("OMNISTAGE_KUBECTL"):
        return
    if not any(item.get_closest_marker("cluster") for item in session.items):
        return
    proc = _live(session.config, ["bash", str(HACK / "build-k8s-bins.sh")], timeout=BUILD_TIMEOUT)
    if proc.returncode != 0:
        pytest.exit("hack/build-k8s-bins.sh failed; see its output above", returncode=1)


def _kubectl_binary() -> str:
    found = cached_binary("kubectl", "OMNISTAGE_KUBECTL")
    if found is not None:
        return found
    if USE_EXISTING and shutil.which("kubectl"):
        return shutil.which("kubectl")  # kind users have one; no need to build Kubernetes for it
    pytest.fail("no kubectl: run `make k8s-bins`, or set OMNISTAGE_KUBECTL")


@pytest.fixture(scope="session")
def wait_for() -> Callable[..., Any]:
    """wait_for(description, predicate, timeout=60, interval=0.5) -> the predicate's truthy value."""
    return _wait_for


@contextlib.contextmanager
def _cluster_lock(config: pytest.Config) -> Iterator[None]:
    """Serialise start and stop of the local cluster between pytest sessions sharing this machine."""
    lock = CLUSTER_DIR.with_name(CLUSTER_DIR.name + ".lock")
    with open(lock, "w") as f:
        def take() -> bool:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
        if not take():
            with _uncaptured(config):
                _wait_for(f"another session's hold on {lock}", take, timeout=CLUSTER_UP_TIMEOUT, interval=1)
        yield


def _other_users(me: Path) -> list[Path]:
    """Pid files of other live pytest sessions using the local cluster (dead ones are pruned)."""
    alive = []
    for user in (CLUSTER_DIR / "users").glob("*"):
        if user == me:
            continue
        try:
            os.kill(int(user.name), 0)
            alive.append(user)
        except (ProcessLookupError, ValueError):
            user.unlink(missing_ok=True)
    return alive


@pytest.fixture(scope="session")
def kubeconfig(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Path of the session cluster's kubeconfig, also exported as KUBECONFIG for the session.

    The local cluster is shared: a session registers itself in CLUSTER_DIR/users, and the last
    session out stops a cluster that a session started (marker `started-by-pytest`). A cluster
    started with `make cluster-up` is never stopped here.
    """
    config = request.config
    if USE_EXISTING:
        if not os.environ.get("KUBECONFIG"):
            pytest.fail("OMNISTAGE_USE_EXISTING_CLUSTER=1 needs KUBECONFIG pointing at the cluster")
        path = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    else:
        path = CLUSTER_DIR / "admin.kubeconfig"
        me = CLUSTER_DIR / "users" / str(os.getpid())
        with _cluster_lock(config):
            check = subprocess.run(["bash", str(HACK / "cluster-up.sh"), "--check"], timeout=60, check=False)
            running = check.returncode == 0
            proc = _live(config, ["bash", str(HACK / "cluster-up.sh")], timeout=CLUSTER_UP_TIMEOUT)
            if proc.returncode != 0:
                pytest.fail("hack/cluster-up.sh failed; see its output above")
            if not running:
                (CLUSTER_DIR / "started-by-pytest").touch()
            me.parent.mkdir(exist_ok=True)
            me.touch()
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(path)
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        if not USE_EXISTING:
            with _cluster_lock(config):
                me.unlink(missing_ok=True)
                others = _other_users(me)
                if KEEP or others or not (CLUSTER_DIR / "started-by-pytest").exists():
                    why = ("OMNISTAGE_KEEP_CLUSTER=1" if KEEP else f"{len(others)} other session(s) use it"
                           if others else "it was running before the session")
                    with _uncaptured(config):
                        print(f"\n[cluster] left running ({why}): export KUBECONFIG={path}  (stop: make cluster-down)")
                else:
                    _live(config, ["bash", str(HACK / "cluster-down.sh")], timeout=CLUSTER_DOWN_TIMEOUT)


@pytest.fixture(scope="session")
def local_cluster() -> bool:
    """True on the local control plane (kwok nodes, loopback pod IPs), False on kind or a real cluster."""
    return not USE_EXISTING


@pytest.fixture(scope="session")
def kubectl(kubeconfig: Path) -> Kubectl:
    return Kubectl(_kubectl_binary(), kubeconfig)


@pytest.fixture(scope="session")
def omnistage_crd(kubectl: Kubectl) -> dict[str, Any]:
    """Install the committed CRDs (OmniStage, OmniStagePool) and wait until the API server serves them."""
    if not CRD_FILE.exists():
        pytest.fail(f"{CRD_FILE.relative_to(ROOT)} is missing (generate it with `make crd`)")
    # Server-side apply: a generated CRD can outgrow the last-applied annotation of client-side apply.
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=omnistage-tests", "-f", str(CRD_FILE))
    for name in (CRD_NAME, POOL_CRD_NAME):  # the file holds both kinds
        _wait_for(f"CRD {name} Established", lambda n=name: kubectl(
            "wait", "--for=condition=Established", f"crd/{n}", "--timeout=5s", check=False).returncode == 0,
            timeout=60)
    _wait_for_garbage_collector(kubectl)
    return kubectl.json("get", "crd", CRD_NAME)


def _wait_for_garbage_collector(kubectl: Kubectl) -> None:
    """Wait until deleting an OmniStage deletes what it owns.

    The controller manager's garbage collector rediscovers resource types every 30 s; until it
    watches a new CRD, children of a deleted OmniStage linger for up to that long. Probing once
    here keeps every deletion test deterministic (instant when the CRD was already known).
    """
    ns = f"gc-probe-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", ns)
    try:
        owner = {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStage",
                 "metadata": {"name": "probe"}, "spec": {"model": "probe"}}
        kubectl("create", "-n", ns, "-f", "-", input=json.dumps(owner))
        uid = kubectl("get", "omnistage", "probe", "-n", ns, "-o", "jsonpath={.metadata.uid}").stdout
        child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe-child", "ownerReferences": [
            {"apiVersion": owner["apiVersion"], "kind": "OmniStage", "name": "probe", "uid": uid}]}}
        kubectl("create", "-n", ns, "-f", "-", input=json.dumps(child))
        kubectl("delete", "omnistage", "probe", "-n", ns)
        _wait_for("the garbage collector to collect an OmniStage's children", lambda: kubectl(
            "get", "configmap", "probe-child", "-n", ns, check=False).returncode != 0, timeout=120)
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found")


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kubectl: Kubectl) -> Iterator[str]:
    """A fresh namespace per test; deleted afterwards (the namespace controller removes its contents)."""
    name = create_test_namespace(kubectl, request.node.name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


# ----- install manifests, Helm, the operator's own identity ----------------------------------------

def _helm_binary() -> str:
    found = cached_binary("helm", "OMNISTAGE_HELM")
    if found is not None:
        return found
    if USE_EXISTING and shutil.which("helm"):
        return shutil.which("helm")
    pytest.fail("no helm: run `make k8s-bins` (builds it from its Go module), or set OMNISTAGE_HELM")


class Helm(Kubectl):
    """The real helm, pointed at the session's cluster, with its own (empty) config and cache
    directories so neither a user's repositories nor plugins take part."""

    def __init__(self, binary: str, kubeconfig: Path, home: Path):
        env = {**{k: v for k, v in os.environ.items() if "proxy" not in k.lower()},
               "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
               "HELM_DATA_HOME": str(home / "data")}
        super().__init__(binary, kubeconfig, timeout=180, env=env, cwd=ROOT)


@pytest.fixture(scope="session")
def helm(kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(_helm_binary(), kubeconfig, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def kustomize(kubectl: Kubectl) -> Callable[[str | Path], list[dict[str, Any]]]:
    """kustomize(path) -> the documents `kubectl kustomize path` renders (what `apply -k` sends)."""
    import yaml

    def build(path: str | Path) -> list[dict[str, Any]]:
        out = kubectl("kustomize", str(path)).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    return build


@pytest.fixture(scope="session")
def third_party_crds() -> Path:
    """Upstream CRDs copied from their Go modules by hack/build-k8s-bins.sh: KEDA's ScaledObject and
    the Prometheus Operator's PodMonitor/ServiceMonitor (real schemas, not stand-ins)."""
    if os.environ.get("OMNISTAGE_THIRD_PARTY_CRDS"):
        return Path(os.environ["OMNISTAGE_THIRD_PARTY_CRDS"])
    bin_dir = k8s_bin_dir()
    if bin_dir is None:
        pytest.fail("no third-party CRDs: run `make k8s-bins`, or set OMNISTAGE_THIRD_PARTY_CRDS")
    return bin_dir / "third-party-crds"


def with_namespace(node: Any, namespace: str) -> Any:
    """The manifests with every mention of their namespace (metadata, subjects, `--namespace=`
    arguments) moved to `namespace`, the way the chart templates it."""
    if isinstance(node, dict):
        return {k: with_namespace(v, namespace) for k, v in node.items()}
    if isinstance(node, list):
        return [with_namespace(v, namespace) for v in node]
    return node.replace(MANIFEST_NAMESPACE, namespace) if isinstance(node, str) else node


@dataclass
class OperatorIdentity:
    """The operator's ServiceAccount and RBAC from manifests/ applied to the cluster, and a kubeconfig
    that authenticates as that ServiceAccount with a token from the TokenRequest API, as the
    Deployment's pod would. `kubectl` acts as the operator; `env` is the operator container's
    environment from the Deployment (OMNISTAGE_ENGINE_IMAGE)."""

    overlay: str
    namespace: str
    kubeconfig: Path
    kubectl: Kubectl
    env: dict[str, str]
    objects: list[dict[str, Any]] = field(default_factory=list)
    service_account: str = OPERATOR_SA

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    def can_i(self, verb: str, resource: str, namespace: str | None = None, subresource: str | None = None) -> bool:
        """`kubectl auth can-i` as the operator (a SelfSubjectAccessReview: its own token asks).
        namespace None: all namespaces (or a cluster-scoped resource)."""
        where = ["-n", namespace] if namespace else ["--all-namespaces"]
        sub = [f"--subresource={subresource}"] if subresource else []
        proc = self.kubectl("auth", "can-i", verb, resource, *where, *sub, check=False)
        answer = (proc.stdout.strip().split() or [""])[0]
        if answer not in ("yes", "no"):
            raise AssertionError(f"kubectl auth can-i {verb} {resource} answered {proc.stdout!r} {proc.stderr!r}")
        return answer == "yes"


# The kinds that make up the operator's identity; the CRD belongs to the omnistage_crd fixture and
# the Deployment is replaced by the operator process of the tests.
_IDENTITY_KINDS = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
_OVERLAYS = {"base": MANIFESTS / "base", "namespaced": MANIFESTS / "overlays" / "namespaced"}


@pytest.fixture(scope="session")
def service_account_kubeconfig(kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """service_account_kubeconfig(name, namespace) -> a kubeconfig (mode 0600) that authenticates as
    that ServiceAccount with a token from the TokenRequest API (`kubectl create token`): a bound,
    expiring token like the one the kubelet projects into a pod, on the session's cluster."""
    cluster = kubectl.json("config", "view", "--raw", "--minify", "--flatten")["clusters"][0]["cluster"]

    def make(name: str, namespace: str) -> Path:
        # Long enough for the slowest session; the identities are deleted at its end anyway.
        token = kubectl("create", "token", name, "-n", namespace, "--duration=6h").stdout.strip()
        if not token:
            pytest.fail(f"kubectl create token {name} -n {namespace} returned no token")
        user = f"system:serviceaccount:{namespace}:{name}"
        path = tmp_path_factory.mktemp(f"sa-{namespace}-{name}") / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "cluster", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "cluster", "user": user, "namespace": namespace}}],
            "current-context": name,
        }))
        path.chmod(0o600)
        return path

    return make


@pytest.fixture(scope="session")
def operator_identity(kubectl: Kubectl, kustomize, service_account_kubeconfig,
                      omnistage_crd) -> Iterator[Callable[..., OperatorIdentity]]:
    """operator_identity(overlay="base" | "namespaced", namespace=None) -> OperatorIdentity.

    Renders manifests/base (cluster-wide: ClusterRole + ClusterRoleBinding) or
    manifests/overlays/namespaced (RoleBinding in one namespace + cluster-wide CRD discovery) with
    `kubectl kustomize`, keeps the Namespace, ServiceAccount and RBAC objects unchanged but for two
    renames: the namespace (default: a fresh omnistage-system-<hex>, so sessions sharing a cluster
    never share an identity, and a real installation on an existing cluster is left alone) and a
    -<hex> suffix on cluster-scoped names. Applied server-side; removed at the end of the session.
    Identities without an explicit namespace are cached for the session."""
    made: list[OperatorIdentity] = []
    cache: dict[str, OperatorIdentity] = {}

    def make(overlay: str = "base", namespace: str | None = None) -> OperatorIdentity:
        if namespace is None and overlay in cache:
            return cache[overlay]
        suffix = uuid.uuid4().hex[:5]
        ns = namespace or f"{MANIFEST_NAMESPACE}-{suffix}"
        rendered = kustomize(_OVERLAYS[overlay])
        deployment = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == OPERATOR_SA)
        container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "operator")
        env = container_env(container)
        objects = []
        for doc in rendered:
            if doc["kind"] not in _IDENTITY_KINDS:
                continue
            doc = with_namespace(doc, ns)
            if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                doc["metadata"]["name"] += f"-{suffix}"
            if doc["kind"] in ("RoleBinding", "ClusterRoleBinding") and doc["roleRef"]["kind"] == "ClusterRole":
                doc["roleRef"]["name"] += f"-{suffix}"
            objects.append(doc)
        kinds = sorted(d["kind"] for d in objects)
        if "ServiceAccount" not in kinds or not {"RoleBinding", "ClusterRoleBinding"} & set(kinds):
            pytest.fail(f"{_OVERLAYS[overlay]} renders no ServiceAccount with a binding (got {kinds})")
        print(f"[identity] applying {overlay} RBAC for {ns}/{OPERATOR_SA}: "
              + ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in objects), flush=True)
        kubectl("apply", "--server-side", "--field-manager=omnistage-tests-identity", "-f", "-",
                input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        path = service_account_kubeconfig(OPERATOR_SA, ns)
        user = f"system:serviceaccount:{ns}:{OPERATOR_SA}"
        ident = OperatorIdentity(overlay, ns, path, Kubectl(kubectl.binary, path), env, objects)
        made.append(ident)
        # RBAC is enforced from the authorizer's informer cache: wait until the binding counts.
        probe_ns = None if overlay == "base" else ns
        _wait_for(f"RBAC of {user} in effect", lambda: ident.can_i("list", CRD_NAME, probe_ns), timeout=60)
        who = ident.kubectl.json("auth", "whoami")["status"]["userInfo"]["username"]
        if who != user:
            pytest.fail(f"the operator kubeconfig authenticates as {who!r}, not {user!r}")
        if namespace is None:
            cache[overlay] = ident
        return ident

    yield make
    for ident in made:
        for doc in ident.objects:
            if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found",
                        "--wait=false", check=False)
        if ident.namespace.startswith(f"{MANIFEST_NAMESPACE}-"):
            kubectl("delete", "namespace", ident.namespace, "--ignore-not-found", "--wait=false", check=False)


# ----- the operator and the engines' stand-in runtime, per test module ------------------------------------
# The `namespace` fixture names every test namespace t-<test>-<hex>; the operator and the stand-in
# runtime of a module watch exactly those, so they never touch `make demo`'s.
TEST_NAMESPACES = "t-*"
H200 = "NVIDIA-H200"

@pytest.fixture(scope="module")
def state_dir() -> Path:
    """Logs of the operator and the stand-in engines. Not pytest's tmp_path: its retention deletes
    older session directories, and several sessions may share this machine."""
    path = Path(os.environ.get("OMNISTAGE_TEST_STATE", "/tmp/omnistage-tests")) / \
        f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    print(f"\n[cluster] operator and engine logs in {path}")
    return path


@pytest.fixture(scope="session", autouse=True)
def standin_fork_server(request: pytest.FixtureRequest) -> None:
    """The stand-in engines' fork server, started with the session's first cluster test when the run
    has stand-in cluster tests (tests/cluster itself, not kind/ or real/): its imports overlap the
    cluster's start and the API tests, and the first module's pods fork from it (kubelet.py)."""
    here = Path(__file__).resolve().parent
    if any(Path(item.path).resolve().parent == here for item in request.session.items):
        logs = Path(os.environ.get("OMNISTAGE_TEST_STATE", "/tmp/omnistage-tests"))
        logs.mkdir(parents=True, exist_ok=True)
        warm_fork_server(logs / f"zygote-{os.getpid()}.log")


@pytest.fixture(scope="module")
def kwok_nodes(kubectl) -> bool:
    """True when the GPU nodes are kwok's (no container runs on them): the stand-in runtime is needed."""
    nodes = kubectl.json("get", "nodes", "-l", f"nvidia.com/gpu.product={H200}")["items"]
    return bool(nodes) and all((n["metadata"].get("annotations") or {}).get("kwok.x-k8s.io/node") == "fake"
                               for n in nodes)


@pytest.fixture(scope="module")
def standin(kubeconfig, kwok_nodes, state_dir) -> Iterator[StandinRuntime | None]:
    """The container runtime kwok lacks (simulated nodes only)."""
    if not kwok_nodes:
        yield None  # real kubelets run the real engine image
        return
    with StandinRuntime(kubeconfig=kubeconfig, namespaces=[TEST_NAMESPACES], state_dir=state_dir / "standin") as rt:
        yield rt


# The finalizers Kubernetes itself puts on an object being deleted with a propagation policy.
KUBERNETES_FINALIZERS = {"foregroundDeletion", "orphan"}


@pytest.fixture(scope="module")
def operator_namespaces() -> list[str]:
    """What the module's operator watches (a directory's conftest may narrow it, e.g. tests/cluster/real)."""
    return [TEST_NAMESPACES]


@pytest.fixture(scope="module")
def operator_full_pass_every() -> float | None:
    """How often the module's operator gives every OmniStage a full pass (None: the operator's 60 s).
    A module whose tests wait for a full pass shortens it; modules that count passes keep the default."""
    return None


@pytest.fixture(scope="module")
def operator(kubeconfig, kubectl, omnistage_crd, standin, state_dir, wait_for,
             operator_identity, operator_namespaces, operator_full_pass_every) -> Iterator[OperatorProcess]:
    # Least privilege, proven: the operator runs under its own ServiceAccount with the ClusterRole
    # of manifests/base (a TokenRequest token, conftest.py operator_identity) and the Deployment's
    # environment, never as the admin; a verb the manifests lack fails these tests.
    identity = operator_identity("base")
    op = OperatorProcess(identity.kubeconfig, state_dir / "operator.log", namespaces=operator_namespaces,
                         env=identity.env, probe_heads_every=TESTS_PROBE_HEADS_EVERY,
                         full_pass_every=operator_full_pass_every)
    op.start()
    yield op
    # The operator must never hold a deleted namespace: OmniStages and pools carry no finalizer of its
    # own (the resync is a thread, not a kopf timer). Checked on what is there now rather than by
    # waiting until the namespace controller has removed each test's namespace (about 10 s a module):
    # a regression is a finalizer on an object that only Kubernetes' own would be on.
    def held() -> dict[str, list[str]]:
        items = [o for kind in ("omnistages", "omnistagepools") for o in kubectl.json("get", kind, "-A")["items"]]
        return {f"{o['kind']} {o['metadata']['namespace']}/{o['metadata']['name']}": foreign
                for o in items if (foreign := sorted(set(o["metadata"].get("finalizers") or ()) - KUBERNETES_FINALIZERS))}

    try:
        assert not held(), f"the operator put finalizers on its objects, which would hold deleted namespaces: {held()}"
    finally:
        op.stop()
        # Whatever the operator failed to finalise would keep its namespace Terminating for ever; the
        # failure above is the report, the cluster is left clean.
        for obj in held():
            kind, ref = obj.split(" ", 1)
            namespace, name = ref.split("/", 1)
            print(f"[operator] removing the finalizers the operator left on {obj}")
            kubectl("patch", kind.lower(), name, "-n", namespace, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}', check=False)
    # A verb missing from the ClusterRole does not always fail a test by itself (a retried call, a
    # logged event); the API server's refusal in the log does. Cluster-wide with a glob, nothing
    # may be refused at all.
    denied = op.rbac_denials()
    assert not denied, f"RBAC refused the operator ({identity.user}): {sorted(denied)}; see {op.log_path}"


@pytest.fixture
def operator_log_on_failure(request, operator, standin, kubectl, namespace) -> Iterator[None]:
    """Keep the operator running across tests; on failure print the namespace's Events (the operator's
    decisions) and what the operator and the engines logged."""
    if not operator.alive():
        operator.start()  # a previous test killed it and failed before restarting it
    offset = operator.size()
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(f"\n===== events in {namespace} =====")
        print(kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout)
        print(f"\n===== operator log during this test ({operator.log_path}) =====")
        print(operator.tail(300, since=offset))
        if standin is not None:
            for (ns, pod), p in sorted(standin.processes().items()):
                print(f"\n===== stand-in {ns}/{pod} (pid {p.pid}, {p.log_path}) =====")
                if p.log_path.exists():
                    print("\n".join(p.log_path.read_text(errors="replace").splitlines()[-40:]))
