"""What each engine pod runs: the head's, a stage-0 replica's and a pool pod's command line (the
engine container's args). A replica's and a pool pod's name the head they register with."""

from __future__ import annotations

from ..api.podtemplate import POD_IP_ENV
from .common import Pool, Target
from .config import CONFIG_PATH


def head_args(t: Target) -> list[str]:
    e = t.spec.engine
    args = ["serve", t.spec.model, "--omni", "--deploy-config", CONFIG_PATH, "--host", "0.0.0.0",
            "--port", str(e.http_port)]
    if t.distributed:
        args += ["--stage-id", "0", "--omni-master-address", f"$({POD_IP_ENV})",
                 "--omni-master-port", str(e.master_port),
                 "--omni-heartbeat-timeout", str(e.heartbeat_timeout_seconds),
                 "--stage-init-timeout", str(e.startup_timeout_seconds),
                 "--init-timeout", str(e.startup_timeout_seconds)]
    if not e.log_stats:
        args.append("--disable-log-stats")
    return args + list(e.extra_args)


def replica_args(t: Target, head_ip: str) -> list[str]:
    e = t.spec.engine
    return ["serve", t.spec.model, "--omni", "--headless", "--deploy-config", CONFIG_PATH,
            "--stage-id", "0", "--omni-master-address", head_ip, "--omni-master-port", str(e.master_port),
            "--omni-replica-address", f"$({POD_IP_ENV})", "--worker-backend", "multi_process",
            ] + list(e.extra_args)


def pool_args(t: Target, pool: Pool, head_ip: str) -> list[str]:
    """The supervisor's: the stage ids, then the command it runs once per stage with --stage-id K."""
    e = t.spec.engine
    ids = [a for k in pool.spec.stage_ids for a in ("--stage-id", str(k))]
    return ids + ["--", "vllm", "serve", t.spec.model, "--omni", "--headless", "--deploy-config", CONFIG_PATH,
                  "--omni-master-address", head_ip, "--omni-master-port", str(e.master_port),
                  "--omni-replica-address", f"$({POD_IP_ENV})", "--worker-backend", "multi_process",
                  ] + list(e.extra_args)
