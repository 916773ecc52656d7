"""What in an OmniStage spec is the operator's: the flags it renders on the engine command line, the
environment it sets, the deploy-config keys of a stage. The rules (field_rules.py, template_checks.py;
pipeline_rules.py for spec.stages and spec.transport) refuse them, as CEL and in Python, from these
predicates."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from omnistage_engine_patches import contract

from . import podtemplate as pt
from .engine_spec import EnvVar
from .security import ARGV_EXPANSION, MEMBERSHIP_SECRET_SUFFIX, host_path_allowed, operator_allowed_host_paths
from .specs import OmniStageSpec

# Flags the operator owns on the engine command line (vllm 0.30.0 / vllm-omni 0.30.0 spellings,
# short aliases included); spec.engine.extraArgs may set none of them in any form vLLM's parser
# accepts (the predicates below).
OPERATOR_OWNED_FLAGS = [
    # Membership and topology: a user value would break registration or routing.
    "--omni", "--omni-master-address", "-oma", "--omni-master-port", "-omp", "--stage-id", "--headless",
    "--omni-replica-address", "-ora", "--omni-dp-size-local", "--port",
    # spec.engine.heartbeatTimeoutSeconds.
    "--omni-heartbeat-timeout",
    # More than one API process makes vLLM pick its own frontend cache (processor_only).
    "--api-server-count", "-asc",
    # The stage-0 multimodal cache: the operator renders it from spec.cache (the CLI beats the config).
    "--mm-processor-cache-type", "--mm-processor-cache-gb",
    # The rendered per-stage config and anything that swaps or overrides it.
    "--deploy-config", "--stage-overrides",
    # A YAML file of arguments the operator never sees (it could carry any flag above).
    "--config",
]

# Keys of the rendered stage 0 that carry the cache or the replica count. vllm-omni reads them at
# the top of a stage and inside its nested blocks (runtime:, engine_args:, engine_extras:), so a
# stageOverrides key is checked at any depth.
OPERATOR_OWNED_STAGE_KEYS = ["mm_processor_cache_type", "mm_processor_cache_gb", "num_replicas",
                             "omni_dp_size_local", "stage_id"]

# The operator's environment namespace. OMNISTAGE_STANDIN_* are knobs of the test suite's stand-in
# engine (tests/standin); the real engine and its plugin never read them, so users may set them.
OWNED_ENV_PREFIX = "OMNISTAGE_"
STANDIN_ENV_PREFIX = "OMNISTAGE_STANDIN_"
# Besides the contract's names and the prefix: the engine's address (the master address is $(POD_IP)).
OWNED_ENV_NAMES = sorted({*(n for n in contract.OPERATOR_OWNED_ENV if not n.startswith(OWNED_ENV_PREFIX)),
                           *pt.ADDRESS_ENV})


# ---- spec.engine.extraArgs ----------------------------------------------------------------------
# vLLM's FlexibleArgumentParser (0.30.0) reads a flag as `--flag`, `--flag=v`, `--flag.key=v` (a
# JSON field of the flag), with `_` for `-` after the leading `--`, and abbreviated: argparse's
# allow_abbrev is on, so `--mm-processor-cache-t=shm` sets --mm-processor-cache-type.
# The API server checks the literal spellings (`--flag`, `--flag=`, `--flag.` with - or _), which
# cost CEL only the length of the literals. Cutting the option name out of an argument and
# normalising it costs the length of the argument, which is unbounded: the operator checks the rest.


def _spellings(flag: str) -> list[str]:
    """The flag as written, and with underscores if it is a long flag."""
    if not flag.startswith("--"):
        return [flag]
    return [flag, "--" + flag[2:].replace("-", "_")] if "-" in flag[2:] else [flag]


def _literal_owned_flag(arg: str) -> bool:
    return any(
        arg == s or arg.startswith((s + "=", s + ".")) for f in OPERATOR_OWNED_FLAGS for s in _spellings(f)
    )


def _flag_name(arg: str) -> str:
    """The option name vLLM's parser looks up for `arg` ("" for a value, not a flag)."""
    if not arg.startswith("-") or len(arg) < 2 or arg[1].isdigit():
        return ""
    name = arg.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _resolves_to_owned_flag(arg: str) -> bool:
    """An abbreviation argparse would expand to an owned flag. Three characters ("--x", "-xy")
    at least: shorter is no flag at all. A prefix shared with another flag is ambiguous and
    fails in vLLM anyway, so refusing it costs nothing."""
    name = _flag_name(arg)
    return len(name) >= 3 and any(f.startswith(name) for f in OPERATOR_OWNED_FLAGS)


def owned_flag_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, a in enumerate(spec.engine.extra_args) if _literal_owned_flag(a)]


def respelled_owned_flag_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, a in enumerate(spec.engine.extra_args)
            if _resolves_to_owned_flag(a) and not _literal_owned_flag(a)]


def owned_flags_cel() -> str:
    tests = [f"a == '{s}' || a.startsWith('{s}=') || a.startsWith('{s}.')"
             for f in OPERATOR_OWNED_FLAGS for s in _spellings(f)]
    return "!has(self.engine.extraArgs) || self.engine.extraArgs.all(a, !(" + " || ".join(tests) + "))"


def argv_expansion_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, a in enumerate(spec.engine.extra_args) if ARGV_EXPANSION in a]


def argv_expansion_cel() -> str:
    return f"!has(self.engine.extraArgs) || self.engine.extraArgs.all(a, !a.contains('{ARGV_EXPANSION}'))"


# ---- spec.engine.env ------------------------------------------------------------------------------


def owned_env(name: str) -> bool:
    """VLLM_PLUGINS switches the engine plugin off; OMNISTAGE_* are its switches, the resolved
    cache mode and the membership token; POD_IP and VLLM_HOST_IP are the engine's address. The
    operator renders all of them."""
    if name.startswith(STANDIN_ENV_PREFIX):
        return False
    return name in OWNED_ENV_NAMES or name in contract.OPERATOR_OWNED_ENV or name.startswith(OWNED_ENV_PREFIX)


def owned_env_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].name" for i, e in enumerate(spec.engine.env) if owned_env(e.name)]


def not_owned_env_cel(var: str) -> str:
    """CEL: the env var `var` is not the operator's (the same test as owned_env)."""
    names = ", ".join(f"'{n}'" for n in OWNED_ENV_NAMES)
    return (
        f"!({var}.name in [{names}]) && (!{var}.name.startsWith('{OWNED_ENV_PREFIX}') || "
        f"{var}.name.startsWith('{STANDIN_ENV_PREFIX}'))"
    )


def owned_env_cel() -> str:
    return f"!has(self.engine.env) || self.engine.env.all(e, {not_owned_env_cel('e')})"


def env_value_and_source_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, e in enumerate(spec.engine.env) if e.value_from is not None and e.value]


# ---- the operator's Secrets (NAME-membership) -----------------------------------------------------


def membership_secret(name: Any) -> bool:
    """A Secret name of the form the operator's token Secrets have (any OmniStage's)."""
    return isinstance(name, str) and name.endswith(MEMBERSHIP_SECRET_SUFFIX)


def not_membership_secret_cel(ref: str, key: str = "name") -> str:
    """CEL: the Secret reference `ref` (an object naming its Secret in `key`), where set, is not to a
    membership Secret."""
    return f"!has({ref}) || !has({ref}.{key}) || !{ref}.{key}.endsWith('{MEMBERSHIP_SECRET_SUFFIX}')"


def env_secret_cel(var: str) -> str:
    """CEL: the env var `var` takes no value from a membership Secret."""
    return f"!has({var}.valueFrom) || ({not_membership_secret_cel(var + '.valueFrom.secretKeyRef')})"


def env_secret_items(envs: list[tuple[int, Any]]) -> list[str]:
    """"[i].valueFrom.secretKeyRef.name" of the (index, valueFrom) pairs that read a membership Secret."""
    return [f"[{i}].valueFrom.secretKeyRef.name" for i, value_from in envs
            if membership_secret(pt.mapping(value_from, "secretKeyRef").get("name"))]


def spec_env_secret_items(
    env: Callable[[OmniStageSpec], list[EnvVar]],
) -> Callable[[OmniStageSpec], list[str]]:
    return lambda s: env_secret_items([(i, e.value_from) for i, e in enumerate(env(s))])


# ---- spec.modelVolume.hostPath ------------------------------------------------------------------


def host_path_outside_allow_list(spec: OmniStageSpec) -> list[str]:
    """The operator's configuration decides (security.operator_allowed_host_paths): not pure, like
    the engine image default, and read the same way, from the process's environment."""
    mv = spec.model_volume
    if mv is None or mv.host_path is None:
        return []
    return [] if host_path_allowed(mv.host_path.path, operator_allowed_host_paths()) else [""]


# ---- spec.engine.stageOverrides -------------------------------------------------------------------


def walk(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, key) of every mapping key at any depth, lists included."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            yield here, str(key)
            yield from walk(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}[{i}]")


def owned_stage_key(key: str) -> bool:
    # A dashed spelling of an owned key means nothing else, so it is refused too. A stage's env
    # (env:, runtime.env:) reaches its engine processes, so the operator's variables are refused.
    return key.replace("-", "_") in OPERATOR_OWNED_STAGE_KEYS or owned_env(key)


def owned_stage_paths(spec: OmniStageSpec) -> list[str]:
    return [path for path, key in walk(spec.engine.stage_overrides) if owned_stage_key(key)]
