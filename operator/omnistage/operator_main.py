"""`omnistage run`: start kopf with this operator's handlers, metrics and probes."""

from __future__ import annotations

import logging

import kopf

from . import handlers
from .metrics import serve


def run(namespaces: list[str], metrics_port: int, probe_port: int, bind: str = "0.0.0.0") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers.WATCHED_NAMESPACES[:] = namespaces
    serve(metrics_port, bind)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces or None,
        standalone=True,  # no KopfPeering CRDs: one operator replica (Deployment strategy Recreate)
        liveness_endpoint=f"http://{bind}:{probe_port}/healthz" if probe_port else None,
    )
    return 0
