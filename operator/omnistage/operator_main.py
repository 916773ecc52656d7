"""`omnistage run`: start kopf with this operator's handlers, metrics and probes."""

from __future__ import annotations

import logging
import os

import kopf

from . import api
from .api import security
from .runtime import handlers, leader, probes
from .runtime.informer import STATE
from .runtime.metrics import STATUS, serve

# The address /metrics and the probes bind: the flag, else this variable, else loopback. Metrics name every
# OmniStage the operator watches, every tenant's: whoever reaches the address reads them (docs/security.md).
# The install manifests set the pod's IP (the kubelet's probes and Prometheus reach it, other pods of the
# node's network only through the pod's IP, which a NetworkPolicy can fence); run by hand, it is loopback.
BIND_ADDRESS_ENV = "OMNISTAGE_BIND_ADDRESS"
DEFAULT_BIND_ADDRESS = "127.0.0.1"


def bind_address(flag: str | None) -> str:
    return flag or os.environ.get(BIND_ADDRESS_ENV) or DEFAULT_BIND_ADDRESS


def run(namespaces: list[str], metrics_port: int, probe_port: int, bind: str | None = None,
        engine_image: str | None = None, lease_namespace: str | None = None,
        lease_name: str = leader.LEASE_NAME, allowed_host_paths: str | None = None,
        probe_heads_every: float = handlers.RESYNC_SECONDS,
        full_pass_every: float = handlers.FULL_RESYNC_SECONDS) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if engine_image:
        # The flag beats the environment; the reconcile loop reads the default from there
        # (render.target_from -> api.operator_engine_image), so there is one source at run time.
        os.environ[api.ENGINE_IMAGE_ENV] = engine_image
    logging.getLogger(__name__).info("engine image where spec.engine.image is unset: %s",
                                     api.operator_engine_image())
    if allowed_host_paths is not None:
        os.environ[security.ALLOWED_HOST_PATHS_ENV] = allowed_host_paths  # the same one source, as above
    try:
        host_paths = security.operator_allowed_host_paths()
    except ValueError as err:
        raise SystemExit(f"omnistage run: {err}") from None
    logging.getLogger(__name__).info("host directories spec.modelVolume.hostPath may name: %s",
                                     ", ".join(host_paths) or "none")
    handlers.watch(namespaces)
    handlers.probe_every(probe_heads_every)
    handlers.full_pass_every(full_pass_every)
    lease_namespace = lease_namespace or leader.default_namespace()
    elector, threads = None, ()
    if lease_namespace:
        elector = leader.Elector(lease_namespace, leader.default_identity(), lease_name)
        logging.getLogger(__name__).info("leader election: Lease %s/%s as %s; idle until it holds it",
                                         lease_namespace, lease_name, elector.identity)
        threads = (elector.start(),)
    else:
        logging.getLogger(__name__).warning(
            "leader election off (no --leader-election-namespace, $POD_NAMESPACE or in-cluster namespace): "
            "run exactly one replica")
    leader.configure(elector)
    bind = bind_address(bind)
    logging.getLogger(__name__).info(
        "metrics on %s:%s, probes on %s:%s", bind, metrics_port, bind, probe_port
    )
    serve(metrics_port, bind)
    probes.serve(probe_port, bind, probes.Checks(leading=leader.is_leading, synced=lambda: STATE.synced(0),
                                                 omnistages=STATUS.count, threads=threads))
    try:
        kopf.run(
            clusterwide=not namespaces,
            # empty with clusterwide (kopf iterates it: None crashed its namespace observer)
            namespaces=namespaces,
            # No KopfPeering: with equal priorities kopf's peering freezes every replica; the Lease
            # (leader.py) decides who acts, and kopf runs in every replica so a follower is warm.
            standalone=True,
            # Given, so kopf never derives one from getpass.getuser(): the image's uid 65532 has no
            # passwd entry and that lookup crashed every in-cluster start (found on kind).
            identity=elector.identity if elector is not None else leader.default_identity(),
            # No kopf liveness endpoint: probes.py serves liveness and readiness apart on probe_port.
        )
    finally:
        if elector is not None:
            elector.release()  # a clean stop (rolling update) hands over at once
    return 0
