"""The stand-in engine head as a process (see the package docstring for what is real).

  python -m tests.standin.head --bind-ip 127.77.0.5 --master-port 26000 --http-port 8000 \\
      --token-file /path/token [--replicas-expected N]

Serves on ``--bind-ip:--http-port``: ``/health`` (200 while the orchestrator lives and stage 0
has a live replica), ``/metrics`` and the membership endpoint (``/omnistage/v1/membership``,
bearer token from ``--token-file``). Registration on ``--bind-ip:--master-port``. SIGTERM/SIGINT:
graceful stop (HTTP, then the engine: local replica DOWN, master and coordinator closed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from . import require_loopback

logger = logging.getLogger("tests.standin.head")

PLUGINS = ("vllm_omni_register_models", "omnistage_engine_patches", "omnistage_membership")


class _Stop(BaseException):
    """SIGTERM/SIGINT outside uvicorn's own handling (startup, or re-raised after its shutdown)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.standin.head", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bind-ip", required=True, help="the head pod's IP (loopback)")
    ap.add_argument("--master-port", required=True, type=int, help="--omni-master-port")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--token-file", required=True, help="membership bearer token (the mounted Secret)")
    ap.add_argument("--replicas-expected", type=int, default=0,
                    help="before serving HTTP, wait until this many stage-0 replicas (head-local one "
                         "included) are attached, like a real head waits for its initial remote replicas")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=30.0, help="--omni-heartbeat-timeout")
    ap.add_argument("--lb-policy", default="round-robin", help="--omni-lb-policy")
    ap.add_argument("--stats-interval", type=float, default=2.0,
                    help="seconds between the stand-in engine cores' SchedulerStats batches (0: none)")
    ap.add_argument("--attach-delay", type=float, default=0.0,
                    help="seconds the head-side attach of a new replica takes (the engine handshake)")
    ap.add_argument("--no-log-stats", action="store_true", help="like --disable-log-stats on a real head")
    ap.add_argument("--served-model-name", default="standin")
    ap.add_argument("--model-dir", default=None, help="where to write the weightless model config")
    return ap.parse_args(argv)


def _environment(args: argparse.Namespace) -> None:
    # Before vLLM is imported: loopback only, offline, and the plugin allow-list that makes
    # vLLM's loader mount the membership endpoint (and keeps vllm-omni's own plugin).
    # vLLM's app imports model_hosting_container_standards, which sets the root logger to this
    # level (default ERROR), hiding every INFO/WARNING line of non-vLLM loggers.
    os.environ.setdefault("SAGEMAKER_CONTAINER_LOG_LEVEL", "INFO")
    os.environ["VLLM_HOST_IP"] = args.bind_ip
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    listed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys(listed + list(PLUGINS)))
    os.environ["OMNISTAGE_MEMBERSHIP_TOKEN_FILE"] = os.path.abspath(args.token_file)


async def _serve(app, host: str, port: int) -> None:
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    await uvicorn.Server(config).serve()  # installs SIGTERM/SIGINT handlers: graceful exit


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    require_loopback(args.bind_ip, "bind address")
    if not os.path.exists(args.token_file):
        raise SystemExit(f"token file {args.token_file} does not exist")
    _environment(args)

    def on_signal(signum, _frame):  # before uvicorn takes over (and after it hands the signal back)
        raise _Stop(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s head %(name)s %(levelname)s %(message)s")
    started = time.monotonic()

    import vllm.plugins

    vllm.plugins.load_general_plugins()  # our patches, through vLLM's own loader
    from omnistage_engine_patches import _patching

    from .engine import (
        StandinEngine,
        StandinEngineClient,
        build_http_app,
        build_vllm_config,
        write_tiny_model,
    )

    for outcome in _patching.outcomes().values():
        logger.info("patch %s: %s", outcome.name, outcome.reason)
    engine = None
    try:
        vllm_config = build_vllm_config(write_tiny_model(args.model_dir), args.served_model_name)
        engine = StandinEngine(
            vllm_config,
            bind_ip=args.bind_ip,
            master_port=args.master_port,
            log_stats=not args.no_log_stats,
            heartbeat_timeout=args.heartbeat_timeout,
            lb_policy=args.lb_policy,
            stats_interval=args.stats_interval or None,
            attach_delay=args.attach_delay,
            startup_timeout=args.startup_timeout,
        )
        if args.replicas_expected > 1:
            logger.info("waiting for %d stage-0 replicas to attach", args.replicas_expected)
            engine.wait_for(lambda: len(engine.attached_replica_ids()) >= args.replicas_expected,
                            timeout=args.startup_timeout, interval=0.2, what="the expected replicas")
        from omnistage_engine_patches.report import BOOT_ID

        app = build_http_app(StandinEngineClient(engine), args.bind_ip, args.http_port)
        logger.info("stand-in head ready in %.1fs: boot id %s, http://%s:%d, master %s:%d", time.monotonic() - started,
                    BOOT_ID, args.bind_ip, args.http_port, args.bind_ip, args.master_port)
        asyncio.run(_serve(app, args.bind_ip, args.http_port))
    except _Stop as stop:
        logger.info("signal %d: stopping", stop.args[0])  # a requested stop is a clean exit
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # one stop at a time; SIGKILL still works
            signal.signal(sig, signal.SIG_IGN)
        if engine is not None:
            logger.info("stopping the engine")
            engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
