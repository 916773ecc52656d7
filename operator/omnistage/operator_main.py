"""`omnistage run`: start kopf with this operator's handlers, metrics and probes."""

from __future__ import annotations

import logging
import os

import kopf

from . import api, handlers
from .metrics import serve


def run(namespaces: list[str], metrics_port: int, probe_port: int, bind: str = "0.0.0.0",
        engine_image: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if engine_image:
        # The flag beats the environment; the reconcile loop reads the default from there
        # (render.target_from -> api.operator_engine_image), so there is one source at run time.
        os.environ[api.ENGINE_IMAGE_ENV] = engine_image
    logging.getLogger(__name__).info("engine image where spec.engine.image is unset: %s",
                                     api.operator_engine_image())
    handlers.WATCHED_NAMESPACES[:] = namespaces
    serve(metrics_port, bind)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces or None,
        standalone=True,  # no KopfPeering CRDs: one operator replica (Deployment strategy Recreate)
        liveness_endpoint=f"http://{bind}:{probe_port}/healthz" if probe_port else None,
    )
    return 0
