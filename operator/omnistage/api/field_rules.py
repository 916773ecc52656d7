"""The rules across the spec's own fields (the pipeline and its stages, the cache and the membership,
GPUs, ports, the engine's arguments and environment, the model volume): the first rows of
validation.SPEC_RULES. The longer predicates behind them are owned.py's (what the operator sets).
"""

from __future__ import annotations

from collections.abc import Callable

from omnistage_engine_patches import contract

from ..known_pipelines import PIPELINES as KNOWN_PIPELINES
from .cachemode import SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP, membership_can_change
from .engine_spec import EnvVar
from .owned import (
    OPERATOR_OWNED_FLAGS,
    OPERATOR_OWNED_STAGE_KEYS,
    OWNED_ENV_NAMES,
    OWNED_ENV_PREFIX,
    STANDIN_ENV_PREFIX,
    argv_expansion_cel,
    argv_expansion_items,
    env_secret_cel,
    env_value_and_source_items,
    host_path_outside_allow_list,
    owned_env_cel,
    owned_env_items,
    owned_flag_items,
    owned_flags_cel,
    owned_stage_paths,
    respelled_owned_flag_items,
    spec_env_secret_items,
)
from .rule import Rule, unless
from .security import (
    ALLOWED_HOST_PATHS_ENV,
    GPU_RUNTIME_VARIABLES,
    GPU_RUNTIME_WHY,
    gpu_runtime_env,
    gpu_runtime_env_cel,
)
from .specs import Membership, OmniStageSpec
from .template_checks import MEMBERSHIP_SECRETS, absent_or


def _model_volume_one_source(spec: OmniStageSpec) -> bool:
    mv = spec.model_volume
    return mv is None or (mv.pvc is not None) + (mv.host_path is not None) == 1


# Pipelines with stages 1..n: the head waits at startup for a replica of every remote stage, so such a
# pipeline needs spec.stages (and OmniStagePools to run them).
MULTI_STAGE_PIPELINES = sorted(key for key, stages in KNOWN_PIPELINES.items() if len(stages) > 1)
SINGLE_STAGE_EXAMPLES = (
    "qwen3_omni_moe_thinker_only",
    "qwen2_5_omni_thinker_only",
    "ming_flash_omni_thinker_only",
)

_FLAGS_INSTEAD = (
    "the operator renders them: set spec.cache for the multimodal cache, spec.replicas for "
    "replicas, spec.engine.httpPort/masterPort for ports, spec.engine.heartbeatTimeoutSeconds for the "
    "heartbeat timeout and spec.engine.stageOverrides for other stage-0 keys"
)

# The spec's own environment lists (the engine container's), and how to read each.
SPEC_ENV: tuple[tuple[str, Callable[[OmniStageSpec], list[EnvVar]]], ...] = (
    ("engine.env", lambda s: s.engine.env),
    ("transport.env", lambda s: s.transport.env if s.transport else []),
)


def _env_name_items(
    env: Callable[[OmniStageSpec], list[EnvVar]], refused: Callable[[str], bool]
) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: [f"[{i}].name" for i, e in enumerate(env(s)) if refused(e.name)]


FIELD_RULES = [
    Rule(
        ".pipeline",
        "!has(self.pipeline) || !(self.pipeline in ["
        + ", ".join(f"'{p}'" for p in MULTI_STAGE_PIPELINES)
        + "]) || (has(self.stages) && size(self.stages) > 0)",
        "spec.pipeline names a multi-stage vllm-omni pipeline (stages after stage 0, e.g. qwen3_omni_moe: "
        "thinker, talker, code2wav) and the head waits for every stage at startup: list stages 1..n-1 in "
        "spec.stages and run them with OmniStagePools, or use a single-stage pipeline such as "
        + ", ".join(SINGLE_STAGE_EXAMPLES),
        unless(lambda s: s.pipeline not in MULTI_STAGE_PIPELINES or bool(s.stages)),
    ),
    Rule(
        ".cache.mode",
        f"!(self.cache.mode in [{', '.join(repr(m) for m in contract.SENDER_CACHE_MODES)}] "
        "&& (self.membership == 'dynamic' || self.replicas > 1))",
        SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP,
        unless(lambda s: not (s.cache.mode in contract.SENDER_CACHE_MODES
                               and membership_can_change(s.membership, s.replicas))),
    ),
    Rule(
        ".standby",
        "self.standby == 0 || self.membership == 'dynamic'",
        "spec.standby needs spec.membership dynamic: a standby serves once the operator joins it at run "
        "time, and a static set joins nobody after startup",
        unless(lambda s: s.standby == 0 or s.membership == Membership.DYNAMIC),
    ),
    Rule(
        ".head.standby",
        "self.head.standby == 0 || self.membership == 'dynamic'",
        "spec.head.standby needs spec.membership dynamic: the replicas join the spare head at run time "
        "when it takes over, and a static set joins nobody after startup",
        unless(lambda s: s.head.standby == 0 or s.membership == Membership.DYNAMIC),
    ),
    Rule(
        ".head.standby",
        "self.head.standby == 0 || !has(self.stages) || size(self.stages) == 0",
        "spec.head.standby needs a single-stage pipeline: a multi-stage head serves only once a pool pod of "
        "every stage is bound to it, so a spare would hold a second pipeline's pool pods idle; set "
        "spec.head.standby to 0 or remove spec.stages",
        unless(lambda s: s.head.standby == 0 or not s.stages),
    ),
    Rule(
        ".gpu.count",
        "self.gpu.count >= self.engine.tensorParallelSize",
        "spec.gpu.count must be at least spec.engine.tensorParallelSize (GPUs per replica)",
        unless(lambda s: s.gpu.count >= s.engine.tensor_parallel_size),
    ),
    Rule(
        ".engine.masterPort",
        "self.engine.httpPort != self.engine.masterPort",
        "spec.engine.httpPort and spec.engine.masterPort must differ",
        unless(lambda s: s.engine.http_port != s.engine.master_port),
    ),
    Rule(
        ".engine.membershipPort",
        "self.engine.membershipPort != self.engine.httpPort && self.engine.membershipPort != "
        "self.engine.masterPort",
        "spec.engine.membershipPort must differ from spec.engine.httpPort and spec.engine.masterPort",
        unless(lambda s: s.engine.membership_port not in (s.engine.http_port, s.engine.master_port)),
    ),
    Rule(
        ".engine.extraArgs",
        owned_flags_cel(),
        "spec.engine.extraArgs must not set flags the operator manages ("
        + ", ".join(OPERATOR_OWNED_FLAGS)
        + "; as --flag, --flag=value or --flag.key=value, with - or _); "
        + _FLAGS_INSTEAD,
        owned_flag_items,
    ),
    Rule(
        ".engine.extraArgs",
        # Abbreviations and mixed spellings: see above, the operator checks.
        None,
        "spec.engine.extraArgs must not set flags the operator manages in a spelling vLLM expands "
        "(an abbreviation such as --mm-processor-cache-t, or mixed - and _); " + _FLAGS_INSTEAD,
        respelled_owned_flag_items,
    ),
    Rule(
        ".engine.extraArgs",
        argv_expansion_cel(),
        "spec.engine.extraArgs must not contain $( : Kubernetes replaces $(VAR) in a container's arguments "
        "with the variable's value (a Secret's too) and vLLM publishes some of them (--served-model-name on "
        "/v1/models); the operator builds the engine's command line, so write every value literally",
        argv_expansion_items,
    ),
    Rule(
        ".engine.env",
        owned_env_cel(),
        "spec.engine.env must not set variables the operator manages ("
        + ", ".join(OWNED_ENV_NAMES)
        + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): they switch the "
        "engine plugin off or on, set the frontend cache, carry the membership token and the engine's "
        "address; use spec.cache for the cache",
        owned_env_items,
    ),
    Rule(
        ".engine.stageOverrides",
        # CEL cannot see into a preserve-unknown-fields object, so only the operator checks this.
        None,
        "spec.engine.stageOverrides must not set "
        + ", ".join(OPERATOR_OWNED_STAGE_KEYS)
        + f" or the operator's variables ({', '.join(OWNED_ENV_NAMES)}, {OWNED_ENV_PREFIX}*) at any depth "
        "(e.g. runtime.num_replicas, engine_args.mm_processor_cache_type); use spec.cache and spec.replicas "
        "instead",
        owned_stage_paths,
    ),
    Rule(
        ".modelVolume",
        "!has(self.modelVolume) || (has(self.modelVolume.pvc) ? 1 : 0) + (has(self.modelVolume.hostPath) ? 1 "
        ": 0) == 1",
        "spec.modelVolume needs exactly one of pvc or hostPath",
        unless(_model_volume_one_source),
    ),
    Rule(
        ".engine.env",
        "!has(self.engine.env) || self.engine.env.all(e, !has(e.valueFrom) || !has(e.value) || e.value == "
        "'')",
        "spec.engine.env entries take value or valueFrom, not both",
        env_value_and_source_items,
    ),
    *(
        Rule(
            f".{path}",
            absent_or(path, f"self.{path}.all(e, {env_secret_cel('e')})"),
            f"spec.{path} must not take a value from {MEMBERSHIP_SECRETS}",
            spec_env_secret_items(env),
        )
        for path, env in SPEC_ENV
    ),
    *(
        Rule(
            f".{path}",
            absent_or(path, f"self.{path}.all(e, {gpu_runtime_env_cel('e.name')})"),
            f"spec.{path} must not set {GPU_RUNTIME_VARIABLES}: {GPU_RUNTIME_WHY}",
            _env_name_items(env, gpu_runtime_env),
        )
        for path, env in SPEC_ENV
    ),
    Rule(
        ".modelVolume.hostPath.path",
        # The operator's configuration, which the API server cannot see; it refuses only what is never
        # allowed (the field's own rule, security.HOST_PATH).
        None,
        "spec.modelVolume.hostPath.path must be at or below a host directory the operator's administrator "
        f"allows ({ALLOWED_HOST_PATHS_ENV} of the operator: `omnistage run --allowed-host-paths`, the chart "
        "value allowedHostPaths; none by default): a host directory is open to every pod that mounts it, so "
        "the cluster decides which; use spec.modelVolume.pvc, or ask for the directory to be allowed",
        host_path_outside_allow_list,
    ),
]
