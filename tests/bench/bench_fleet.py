"""Fleet benchmark on the local control plane: the operator at 1, 50, 200, 1,000 OmniStages.
Prints figures, asserts nothing (issue 10 section 5).

For each N (OmniStages are added, never removed, so the fleet grows from one N to the next):

  rss_mb          the operator's resident set at rest
  cpu_s_min       its CPU seconds per minute at rest (utime + stime from /proc)
  api_req_min     API requests per minute at rest: the API server's own apiserver_request_total
                  on the operator's resources (OPERATOR_RESOURCES) over a window with the operator
                  running, minus the same window without it; "all req/min" the same over every
                  resource but node heartbeats (noisier: the controllers' and kwok's traffic)
  lease_req_min   the same on Leases: the pair's leader election, on top of kwok's node-lease
                  heartbeats (their noise grows with the nodes: read it at small N)
  own_req_min     the operators' own count of the requests they sent (omnistage_operator_api_requests_total
                  on /metrics, Lease included: every request, kopf watches nothing), exact; "-" for an
                  operator tree without that metric
  lease_req_min   the same on Leases: the pair's leader election, on top of kwok's node-lease
                  heartbeats (their noise grows with the nodes: read it at small N)
  own_req_min     the operators' own count of the requests they sent (omnistage_operator_api_requests_total
                  on /metrics, Lease included: every request, kopf watches nothing), exact; "-" for an
                  operator tree without that metric
  scale_s         `replicas: 1 -> 2` on one OmniStage until its replica pod exists (others at rest)
  reconverge_s    operator killed, every OmniStage's NetworkPolicy deleted, operator started:
                  seconds from its start until all N NetworkPolicies are back

The operator runs as deployed: a leader-elected pair (POD_NAMESPACE, POD_NAME as the Deployment
sets them; the Lease in the bench namespace). RSS and CPU are the leader's; a restart keeps the
leader's identity, as a container restart in the same pod does.

Conditions as in the issue: one namespace, single-GPU OmniStages with `membership: dynamic`, heads
on simulated H200 nodes (kwok; nodes added as needed) with nothing listening on their HTTP port.
A second row per N ("10% unreachable") runs a fake head on every head pod's IP (one asyncio
thread in this process: the report and the listing, honouring If-None-Match like the real
membership endpoint) of which 10% accept the connection and never answer.

  python tests/bench/bench_fleet.py [--n 1,50,200,1000] [--window 60] [--operator-tree DIR]

`--operator-tree` runs the operator from another checkout's `operator/` (PYTHONPATH), e.g. a
`git worktree` of an older commit, for before/after tables under the same conditions.

It uses its own control plane (OMNISTAGE_CLUSTER_DIR, default /tmp/omnistage-fleet, and its own
OMNISTAGE_*_PORT values, set below unless given), started with hack/cluster-up.sh when absent.
Wrap it in `flock /tmp/omnistage-cluster-suite.lock` (pod IPs are shared with other local
clusters). Network rule: only loopback is dialled (pod IPs are 127.78.0.0/16 here).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runnable as a script

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from omnistage_engine_patches import contract

from tests.bench.bench_membership import kubectl_binary, wait
from tests.standin.harness import L_OMNISTAGE, L_ROLE, OperatorProcess

FLEET_ENV = {"OMNISTAGE_CLUSTER_DIR": "/tmp/omnistage-fleet", "OMNISTAGE_ETCD_PORT": "23890",
             "OMNISTAGE_ETCD_PEER_PORT": "23900", "OMNISTAGE_API_PORT": "16543", "OMNISTAGE_KCM_PORT": "20357",
             "OMNISTAGE_SCHED_PORT": "20359", "OMNISTAGE_POD_CIDR": "127.78.0.0/24"}
NAMESPACE = "fleet"
HTTP_PORT = 18431  # the heads' OpenAI port: distinct from every other local test's
MEMBERSHIP_PORT = 18432  # the heads' membership port (what the operator dials), likewise
GROUP, VERSION, PLURAL = "serving.omnistage.io", "v1alpha1", "omnistages"
GPUS_PER_NODE = 8
# The plain values of the operator Deployment's env (manifests/base/deployment.yaml), which the
# operator under test gets as deployed (the before tree's Deployment had none of them).
DEPLOYMENT_ENV = {e["name"]: e["value"] for doc in yaml.safe_load_all((ROOT / "manifests/base/deployment.yaml").read_text())
                  if doc and doc.get("kind") == "Deployment"
                  for e in doc["spec"]["template"]["spec"]["containers"][0].get("env") or []
                  if "value" in e and e["name"] != "OMNISTAGE_ENGINE_IMAGE"}


def log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----- the cluster -----------------------------------------------------------------------------------

def cluster_up() -> str:
    for k, v in FLEET_ENV.items():
        os.environ.setdefault(k, v)
    d = Path(os.environ["OMNISTAGE_CLUSTER_DIR"])
    if subprocess.run(["bash", str(ROOT / "hack" / "cluster-up.sh"), "--check"], check=False).returncode != 0:
        log(f"starting the fleet control plane in {d} (hack/cluster-up.sh)")
        subprocess.run(["bash", str(ROOT / "hack" / "cluster-up.sh")], check=True, stdout=subprocess.DEVNULL,
                       timeout=1800)
    return str(d / "admin.kubeconfig")


def ensure_nodes(core: client.CoreV1Api, heads: int) -> None:
    """Enough simulated H200 nodes for `heads` single-GPU heads (+1 scaled replica), each with its
    own loopback pod CIDR 127.78.K.0/24."""
    want = (heads + 1 + GPUS_PER_NODE - 1) // GPUS_PER_NODE + 1
    have = {n.metadata.name for n in core.list_node(label_selector="omnistage.bench/fleet=true").items}
    labels = {"type": "kwok", "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
              "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H200",
              "nvidia.com/gpu.count": "8", "omnistage.bench/fleet": "true"}
    res = {"cpu": "192", "memory": "2Ti", "pods": "110", "ephemeral-storage": "10Ti", "nvidia.com/gpu": "8"}
    added = 0
    for k in range(1, want + 1):
        name = f"fleet-h200-{k}"
        if name in have:
            continue
        core.create_node({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": name, "labels": {**labels, "kubernetes.io/hostname": name},
                                       "annotations": {"kwok.x-k8s.io/node": "fake",
                                                       "node.alpha.kubernetes.io/ttl": "0"}},
                          "spec": {"podCIDR": f"127.78.{k}.0/24", "podCIDRs": [f"127.78.{k}.0/24"]},
                          "status": {"addresses": [{"type": "InternalIP", "address": f"127.76.1.{k}"},
                                                   {"type": "Hostname", "address": name}],
                                     "capacity": res, "allocatable": res}})
        added += 1
    if added:
        log(f"added {added} simulated H200 nodes ({want} fleet nodes)")


def omnistage(name: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "OmniStage", "metadata": {"name": name},
            "spec": {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "pipeline": "qwen3_omni_moe_thinker_only",
                     "replicas": 1, "membership": "dynamic", "cache": {"mode": "auto", "sizeGiB": 4},
                     "engine": {"tensorParallelSize": 1, "httpPort": HTTP_PORT, "membershipPort": MEMBERSHIP_PORT},
                     "gpu": {"resource": "nvidia.com/gpu", "count": 1, "product": "NVIDIA-H200"}}}


def names(n: int) -> list[str]:
    return [f"fleet-{i:04d}" for i in range(n)]


# What the operator reads and writes. The rest of the API server's traffic at rest is the simulated
# kubelets' heartbeats (node Leases, node status), growing with the nodes, and the controllers'
# (Events, Endpoints, namespaces, e.g. still cleaning up a previous run's namespace): it varies by
# hundreds of requests a minute between two windows, more than the operator's whole share. So the
# table counts the requests on these resources; "all" counts every request but node heartbeats. The
# operator posts Events only when something changes, never at rest.
OPERATOR_RESOURCES = ("omnistages", "pods", "configmaps", "services", "secrets", "networkpolicies")
NODE_HEARTBEATS = ("leases", "nodes")


def request_totals(kubectl: list[str]) -> list[tuple[dict[str, str], float]]:
    """The API server's apiserver_request_total samples: (labels, count)."""
    text = subprocess.run([*kubectl, "get", "--raw", "/metrics"], check=True, capture_output=True, text=True,
                          timeout=60).stdout
    return [(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2)))
            for m in re.finditer(r"^apiserver_request_total\{([^}]*)\} (\S+)$", text, re.MULTILINE)]


def api_requests(kubectl: list[str]) -> tuple[float, float, float]:
    """apiserver_request_total summed (on the operator's resources, on every resource but node
    heartbeats, on Leases)."""
    ours = every = leases = 0.0
    for labels, count in request_totals(kubectl):
        resource = labels.get("resource", "")
        ours += count if resource in OPERATOR_RESOURCES else 0.0
        every += count if resource not in NODE_HEARTBEATS else 0.0
        leases += count if resource == "leases" else 0.0
    return ours, every, leases


def omnistage_patches(kubectl: list[str]) -> float:
    """PATCHes of OmniStages (their status) the API server has answered so far."""
    return sum(count for labels, count in request_totals(kubectl)
               if labels.get("resource") == "omnistages" and labels.get("verb") == "PATCH")


def own_requests(operators: list[OperatorProcess]) -> float | None:
    """The operators' own request count (omnistage_operator_api_requests_total), None if they lack it."""
    total, seen = 0.0, False
    for op in operators:
        text = op.metrics() or ""
        for m in re.finditer(r"^omnistage_operator_api_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE):
            total, seen = total + float(m.group(1)), True
    return total if seen else None


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return int(m.group(1)) / 1024 if m else float("nan")


# ----- fake heads (one asyncio thread; a listener per head pod IP) ----------------------------------

class FakeHeads:
    """Answers GET ENGINE_PATH and MEMBERSHIP_PATH on every head pod's IP:MEMBERSHIP_PORT, like a
    distributed head with one local replica, honouring If-None-Match with the same ETags as the
    real endpoint; heads in `hang` accept connections and never answer (unreachable)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers: dict[str, asyncio.AbstractServer] = {}
        self.hang: set[str] = set()
        self.requests = 0
        threading.Thread(target=self.loop.run_forever, daemon=True, name="fake-heads").start()

    def serve(self, ips: list[str]) -> None:
        asyncio.run_coroutine_threadsafe(self._serve([ip for ip in ips if ip not in self.servers]),
                                         self.loop).result(120)

    async def _serve(self, ips: list[str]) -> None:
        for ip in ips:
            assert ip.startswith("127."), ip  # network rule
            self.servers[ip] = await asyncio.start_server(lambda r, w, ip=ip: self._conn(ip, r, w), ip, MEMBERSHIP_PORT)

    def stop(self) -> None:
        async def close() -> None:
            for s in self.servers.values():
                s.close()
            self.servers.clear()
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(60)

    def _bodies(self, ip: str) -> dict[str, dict[str, Any]]:
        boot = f"fleet-{ip}"
        listing = {"bootId": boot, "epoch": 1, "distributed": True, "metricsEnabled": True, "next": None,
                   "stages": {"0": [{"stage": 0, "replicaId": 0, "host": ip, "pod": None, "local": True,
                                     "state": contract.ATTACHED, "registered": True, "attached": True,
                                     "coordinatorStatus": contract.COORD_UP}]}}
        report = {"bootId": boot, "pluginVersion": "fleet-bench", "vllmVersion": None, "vllmOmniVersion": None,
                  "distributed": True, "patches": {},
                  "frontendCache": {"cacheClass": "MultiModalProcessorOnlyCache",
                                    "mode": contract.CACHE_PROCESSOR_ONLY, "requested": None}}
        return {contract.MEMBERSHIP_PATH: listing, contract.ENGINE_PATH: report}

    @staticmethod
    def _etag(path: str, body: dict[str, Any]) -> str:
        if path == contract.MEMBERSHIP_PATH:
            return f'"{body["bootId"]}.{body["epoch"]}"'
        return '"' + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24] + '"'

    async def _conn(self, ip: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if ip in self.hang:
                    await asyncio.sleep(3600)
                self.requests += 1
                lines = head.decode(errors="replace").split("\r\n")
                path = lines[0].split(" ")[1].split("?")[0]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                n = int(headers.get("content-length") or 0)
                if n:
                    await reader.readexactly(n)
                body = self._bodies(ip).get(path)
                if body is None:
                    status, payload, etag = "404 Not Found", b'{"error":"NotFound"}', None
                else:
                    etag = self._etag(path, body)
                    if headers.get("if-none-match") == etag:
                        status, payload = "304 Not Modified", b""
                    else:
                        status, payload = "200 OK", json.dumps(body).encode()
                extra = f"ETag: {etag}\r\n" if etag else ""
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
                             f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


# ----- one N ------------------------------------------------------------------------------------------

class Fleet:
    def __init__(self, kubeconfig: str, operator_tree: Path | None, window: float, state: Path):
        self.kubeconfig = kubeconfig
        api = config.new_client_from_config(config_file=kubeconfig)
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.net = client.NetworkingV1Api(api)
        self.kubectl = [kubectl_binary(), f"--kubeconfig={kubeconfig}"]
        env = {"PYTHONPATH": str(operator_tree / "operator")} if operator_tree else {}
        # As deployed: two replicas electing a leader over a Lease (here in the bench namespace).
        self.operator, self.follower = (
            OperatorProcess(kubeconfig, state / f"operator-{i}.log", namespaces=[NAMESPACE],
                            env={**env, **DEPLOYMENT_ENV, "POD_NAMESPACE": NAMESPACE, "POD_NAME": f"fleet-operator-{i}"})
            for i in (0, 1))
        self.window = window
        self.fakes: FakeHeads | None = None

    def setup(self) -> None:
        subprocess.run([*self.kubectl, "apply", "--server-side", "--force-conflicts", "--field-manager=omnistage-bench",
                        "-f", str(ROOT / "crds" / "omnistage.serving.omnistage.io.yaml")], check=True,
                       capture_output=True, timeout=60)
        subprocess.run([*self.kubectl, "wait", "--for=condition=Established", "crd/omnistages.serving.omnistage.io",
                        "--timeout=60s"], check=True, capture_output=True, timeout=70)
        try:
            self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        except ApiException as e:
            if e.status != 409:
                raise

    def grow(self, n: int) -> None:
        ensure_nodes(self.core, n)
        have = {o["metadata"]["name"] for o in self.omnistages()}
        missing = [x for x in names(n) if x not in have]
        for i, name in enumerate(missing, 1):
            self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, omnistage(name))
            if i % 100 == 0:
                log(f"  created {i}/{len(missing)} OmniStages")
        if missing:
            log(f"created {len(missing)} OmniStages ({n} in all)")

    def omnistages(self) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)["items"]

    def heads(self) -> list[Any]:
        return self.core.list_namespaced_pod(NAMESPACE, label_selector=f"{L_ROLE}=head").items

    def policies(self) -> int:
        return len(self.net.list_namespaced_network_policy(NAMESPACE).items)

    def converged(self, n: int) -> bool:
        with_status = sum(1 for o in self.omnistages() if (o.get("status") or {}).get("head"))
        heads = sum(1 for p in self.heads() if p.status.pod_ip)
        return with_status >= n and heads >= n and self.policies() >= n

    def settle(self, n: int, limit: float = 180.0) -> None:
        """Until the operator stopped writing OmniStages (status patches: the tail of a convergence,
        which at 1,000 outlasts a fixed pause): at most max(1, N/200) PATCHes in 5 s, for both trees."""
        time.sleep(10)
        start, last = time.monotonic(), omnistage_patches(self.kubectl)
        while time.monotonic() - start < limit:
            time.sleep(5)
            now = omnistage_patches(self.kubectl)
            if now - last <= max(1, n // 200):
                return
            log(f"  settling: {now - last:.0f} OmniStage writes in the last 5s")
            last = now
        log(f"  still writing after {limit:.0f}s; measuring anyway")

    def rest(self, what: str, n: int = 0) -> dict[str, float]:
        """One window with nothing but the operator (if running) at work."""
        self.settle(n)
        log(f"  measuring {what} for {self.window:.0f}s")
        pid = self.operator.popen.pid if self.operator.alive() else None
        cpu0 = proc_cpu_seconds(pid) if pid else 0.0
        pair = [op for op in (self.operator, self.follower) if op.alive()]
        own0, r0, t0 = own_requests(pair), api_requests(self.kubectl), time.monotonic()
        time.sleep(self.window)
        r1, t1, own1 = api_requests(self.kubectl), time.monotonic(), own_requests(pair)
        minutes = (t1 - t0) / 60
        out = {"api_req_min": (r1[0] - r0[0]) / minutes, "api_all_min": (r1[1] - r0[1]) / minutes,
               "lease_req_min": (r1[2] - r0[2]) / minutes}
        if own0 is not None and own1 is not None:
            out["own_req_min"] = (own1 - own0) / minutes
        if pid:
            out["cpu_s_min"] = (proc_cpu_seconds(pid) - cpu0) / minutes
            out["rss_mb"] = proc_rss_mb(pid)
        return out

    def scale_reaction(self, name: str) -> float:
        sel = f"{L_OMNISTAGE}={name},{L_ROLE}=replica"
        patch = {"spec": {"replicas": 2}}
        t0 = time.monotonic()
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, patch)
        wait(f"{name}'s replica pod", lambda: self.core.list_namespaced_pod(NAMESPACE, label_selector=sel).items,
             timeout=120, interval=0.05)
        took = time.monotonic() - t0
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": {"replicas": 1}})
        wait(f"{name} back to one pod", lambda: not self.core.list_namespaced_pod(NAMESPACE, label_selector=sel).items,
             timeout=120, interval=0.2)
        return took

    def start_pair(self) -> None:
        """The leader first (it keeps its identity, so it renews at once), then the follower."""
        for op in (self.operator, self.follower):
            if not op.alive():
                op.start()

    def restart_reconverge(self, n: int) -> float:
        self.operator.kill()
        self.net.delete_collection_namespaced_network_policy(NAMESPACE)
        wait("every NetworkPolicy deleted", lambda: self.policies() == 0, timeout=120, interval=0.2)
        t0 = time.monotonic()
        self.operator.start()
        wait(f"{n} NetworkPolicies back", lambda: self.policies() >= n, timeout=1800, interval=0.2)
        return time.monotonic() - t0

    def run(self, n: int) -> list[dict[str, Any]]:
        rows = []
        self.grow(n)
        if self.fakes:
            self.fakes.stop()
        self.start_pair()
        t0 = time.monotonic()
        wait(f"{n} OmniStages converged", lambda: self.converged(n), timeout=3600, interval=2)
        log(f"N={n}: converged after {time.monotonic() - t0:.0f}s (nothing listening on the heads)")
        row: dict[str, Any] = {"N": n, "heads": "none listening", **self.rest("at rest", n)}
        row["scale_s"] = self.scale_reaction(names(n)[-1])
        log(f"  scale reaction {row['scale_s']:.2f}s")
        self.operator.kill()
        self.follower.kill()
        baseline = self.rest("the baseline (no operator)")
        base = {k: baseline[k] for k in ("api_req_min", "api_all_min", "lease_req_min")}
        subtract(row, base)
        self.net.delete_collection_namespaced_network_policy(NAMESPACE)
        wait("every NetworkPolicy deleted", lambda: self.policies() == 0, timeout=120, interval=0.2)
        t0 = time.monotonic()
        self.start_pair()
        wait(f"{n} NetworkPolicies back", lambda: self.policies() >= n, timeout=1800, interval=0.2)
        row["reconverge_s"] = time.monotonic() - t0
        log(f"  reconverged after a restart in {row['reconverge_s']:.1f}s")
        rows.append(row)

        # The same with heads answering, 10% of them never (accept, then silence).
        ips = sorted(p.status.pod_ip for p in self.heads() if p.status.pod_ip)
        self.fakes = self.fakes or FakeHeads()
        self.fakes.hang = set(ips[9::10])  # every tenth: none of 1, 5 of 50
        self.fakes.serve(ips)
        log(f"  fake heads on {len(ips)} IPs, {len(self.fakes.hang)} of them never answer")
        wait("the heads' answers in status", lambda: self.fakes.requests >= len(ips) - len(self.fakes.hang),
             timeout=600)
        row2: dict[str, Any] = {"N": n, "heads": "10% unreachable", **self.rest("at rest, heads answering", n)}
        subtract(row2, base)
        row2["scale_s"] = self.scale_reaction(names(n)[-1])
        log(f"  scale reaction {row2['scale_s']:.2f}s")
        row2["reconverge_s"] = self.restart_reconverge(n)
        log(f"  reconverged after a restart in {row2['reconverge_s']:.1f}s")
        rows.append(row2)
        return rows


def subtract(row: dict[str, Any], baseline: dict[str, float]) -> None:
    """Request rates minus the same window without the operator; the baselines kept for the table."""
    for key, value in baseline.items():
        row[key] -= value
        row[key.replace("_min", "_base")] = value


def table(rows: list[dict[str, Any]], title: str) -> str:
    cols = [("N", "OmniStages", "{:d}"), ("heads", "heads", "{}"), ("rss_mb", "RSS MB", "{:.0f}"),
            ("cpu_s_min", "CPU s/min", "{:.2f}"), ("api_req_min", "API req/min", "{:.0f}"),
            ("api_req_base", "(baseline)", "{:.0f}"), ("api_all_min", "all req/min", "{:.0f}"),
            ("api_all_base", "(baseline)", "{:.0f}"), ("lease_req_min", "Lease req/min", "{:.0f}"),
            ("lease_req_base", "(baseline)", "{:.0f}"), ("own_req_min", "own count req/min", "{:.1f}"),
            ("scale_s", "scale s", "{:.2f}"),
            ("reconverge_s", "reconverge s", "{:.1f}")]
    out = [title, "| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f.format(r[k]) if k in r else "-" for k, _, f in cols) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,50,200,1000", help="comma-separated fleet sizes, ascending")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per at-rest measurement")
    ap.add_argument("--operator-tree", type=Path, help="run the operator from this checkout's operator/")
    ap.add_argument("--label", default="", help="title of the printed table")
    ap.add_argument("--keep", action="store_true", help="leave the namespace and its OmniStages behind")
    args = ap.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one listener per fake head

    kubeconfig = cluster_up()
    state = Path("/tmp/omnistage-bench/fleet")
    fleet = Fleet(kubeconfig, args.operator_tree, args.window, state)
    log(f"operator from {args.operator_tree or ROOT}; log {fleet.operator.log_path}")
    fleet.setup()
    rows: list[dict[str, Any]] = []
    try:
        for n in (int(x) for x in args.n.split(",")):
            rows += fleet.run(n)
            print(table(rows, f"fleet benchmark {args.label} (so far)"), flush=True)
    finally:
        fleet.operator.stop()
        fleet.follower.stop()
        if fleet.fakes:
            fleet.fakes.stop()
        if not args.keep:  # the next run starts from an empty namespace and free GPUs
            subprocess.run([*fleet.kubectl, "delete", "namespace", NAMESPACE, "--wait=false"], check=False,
                           capture_output=True, timeout=60)
            log(f"deleting namespace {NAMESPACE}")
            wait(f"namespace {NAMESPACE} gone", lambda: subprocess.run(
                [*fleet.kubectl, "get", "namespace", NAMESPACE], check=False, capture_output=True).returncode != 0,
                 timeout=900, interval=2)
    print()
    print(table(rows, f"fleet benchmark {args.label}: window {args.window:.0f}s, operator {args.operator_tree or ROOT}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
