"""The stand-in engine head as a process (see the package docstring for what is real).

  python -m tests.standin.head --bind-ip 127.77.0.5 --master-port 26000 --http-port 8000 \\
      --token-file /path/token [--replicas-expected N] [--stages N --startup-timeout T]

Serves on ``--bind-ip:--http-port``: ``/health`` (vllm-omni's ``OmniBase.check_health``: 200 while
the orchestrator lives and every stage that had replicas has a live one), ``/metrics`` and the
membership endpoint (``/omnistage/v1/membership``, bearer token from ``--token-file``; listing,
join and leave for every stage). Registration on ``--bind-ip:--master-port``. SIGTERM/SIGINT:
graceful stop (HTTP, then the engine: local replica DOWN, master and coordinator closed).

``--stages N`` (N > 1, issue 12): the head of an N-stage pipeline (``multistage.MultiStageEngine``:
vllm-omni's real ``StageRuntime.initialize`` for stage 0 head-local and stages 1..N-1 remote, one
planned replica each, as the operator's deploy config says with ``num_replicas: 1``). Like
``vllm serve --omni --stage-id 0`` with such a config it serves no HTTP until one replica of each
remote stage registered, and exits 1 when one has not within ``--startup-timeout`` (the real
``--stage-init-timeout`` wait, ``OmniMasterServer.get_stage_config``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import require_loopback

if TYPE_CHECKING:  # imports vLLM: only after the environment is set (main)
    from .multistage import MultiStageOptions

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
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="bound of the head's startup; with --stages N > 1 the stage-init timeout "
                         "(--stage-init-timeout of the head pod)")
    ap.add_argument("--stages", type=int, default=1,
                    help="stages of the pipeline (len(stages) of the deploy config); 1: stage 0 only")
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


def _pipeline_options(args: argparse.Namespace, model_dir: Path) -> MultiStageOptions:
    """The N-stage plan (``multistage.chain_specs``) with a weightless ``VllmConfig`` per stage;
    stage 0's frontend as the single-stage head builds it, so the engine report is the same."""
    from .engine import standin_frontend
    from .multistage import MultiStageOptions, chain_specs, stage_vllm_config

    specs = chain_specs(args.stages)
    configs = [stage_vllm_config(model_dir, spec, len(specs), async_chunk=False) for spec in specs]
    configs[0].model_config.served_model_name = args.served_model_name  # what /metrics labels
    return MultiStageOptions(specs, configs, stage_init_timeout=max(1, round(args.startup_timeout)),
                             frontend=standin_frontend)


def _abandon_startup(pipeline: MultiStageOptions) -> None:
    """SIGTERM while the head still waits for its remote stages: what the real startup does on
    failure (``_cleanup_after_initialize_failure``: the head-local replica's DOWN, master and
    coordinator stopped), then exit at once. The stage-init waits run on vllm-omni's worker threads,
    which cannot be interrupted and which the interpreter would join at exit (up to the timeout)."""
    for runtime in pipeline.runtimes:
        try:
            runtime._cleanup_after_initialize_failure()
        except Exception:  # best effort: the process ends either way
            logger.warning("cleanup of the unfinished startup failed", exc_info=True)
    logging.shutdown()
    os._exit(0)


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

    from tests.support.tiny_models import build_config_only_model

    from .engine import (
        StandinEngine,
        StandinEngineClient,
        build_http_app,
        build_vllm_config,
        wait_quietly,
    )

    for outcome in _patching.outcomes().values():
        logger.info("patch %s: %s", outcome.name, outcome.reason)
    engine = pipeline = None
    try:
        model_dir = build_config_only_model(args.model_dir)
        engine_kwargs = {"bind_ip": args.bind_ip, "master_port": args.master_port, "log_stats": not args.no_log_stats,
                         "heartbeat_timeout": args.heartbeat_timeout, "lb_policy": args.lb_policy,
                         "stats_interval": args.stats_interval or None, "attach_delay": args.attach_delay}
        if args.stages > 1:
            from .multistage import MultiStageEngine

            pipeline = _pipeline_options(args, model_dir)
            logger.info("%d-stage head: waiting up to %.0fs for one replica of each of stages 1..%d",
                        args.stages, args.startup_timeout, args.stages - 1)
            # Blocks like the real head until every remote stage registered; raises on the
            # stage-init timeout. The outer bound is wider, so the real wait's error is the one raised.
            engine = MultiStageEngine(pipeline, startup_timeout=args.startup_timeout + 60, **engine_kwargs)
        else:
            vllm_config = build_vllm_config(model_dir, args.served_model_name)
            engine = StandinEngine(vllm_config, startup_timeout=args.startup_timeout, **engine_kwargs)
        if args.replicas_expected > 1:
            logger.info("waiting for %d stage-0 replicas to attach", args.replicas_expected)
            wait_quietly("the expected replicas",
                         lambda: len(engine.attached_replica_ids()) >= args.replicas_expected,
                         args.startup_timeout, interval=0.2)
        from omnistage_engine_patches.report import BOOT_ID

        app = build_http_app(StandinEngineClient(engine), args.bind_ip, args.http_port)
        logger.info("stand-in head ready in %.1fs: boot id %s, http://%s:%d, master %s:%d", time.monotonic() - started,
                    BOOT_ID, args.bind_ip, args.http_port, args.bind_ip, args.master_port)
        asyncio.run(_serve(app, args.bind_ip, args.http_port))
    except _Stop as stop:
        logger.info("signal %d: stopping", stop.args[0])  # a requested stop is a clean exit
        if engine is None and pipeline is not None:
            _abandon_startup(pipeline)
    except Exception:  # a failed start is the container's non-zero exit
        logger.exception("stand-in head failed")
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # one stop at a time; SIGKILL still works
            signal.signal(sig, signal.SIG_IGN)
        if engine is not None:
            logger.info("stopping the engine")
            engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
