"""Every rule a valid OmniStage obeys beyond per-field constraints.

Each rule is written twice on purpose, once as CEL (the API server enforces it, see crd.py)
and once in Python (`omnistage render` and the reconcile loop enforce it), with one message.
A rule CEL cannot express (cel=None) is enforced by the operator alone: the OmniStage gets
Ready=False, reason InvalidSpec, and its running pods are left alone. The operator's problems name
the exact item or key (spec.engine.extraArgs[2], spec.engine.stageOverrides.runtime.num_replicas).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from omnistage_engine_patches import contract
from pydantic import ValidationError

from .api import MAX_NAME_LENGTH, OPERATOR_OWNED_FLAGS, OmniStageSpec
from .cachemode import SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP, membership_can_change

# Keys of the rendered stage 0 that carry the cache or the replica count. vllm-omni reads them at
# the top of a stage and inside its nested blocks (runtime:, engine_args:, engine_extras:), so a
# stageOverrides key is checked at any depth.
OPERATOR_OWNED_STAGE_KEYS = ["mm_processor_cache_type", "mm_processor_cache_gb", "num_replicas",
                             "omni_dp_size_local", "stage_id"]

# The operator's environment namespace. OMNISTAGE_STANDIN_* are knobs of the test suite's stand-in
# engine (tests/standin); the real engine and its plugin never read them, so users may set them.
OWNED_ENV_PREFIX = "OMNISTAGE_"
STANDIN_ENV_PREFIX = "OMNISTAGE_STANDIN_"
_OWNED_ENV_NAMES = sorted(n for n in contract.OPERATOR_OWNED_ENV if not n.startswith(OWNED_ENV_PREFIX))


@dataclass(frozen=True)
class Rule:
    field: str  # relative to spec, as the API server's fieldPath
    cel: str | None
    message: str
    # The parts of `field` that break the rule, relative to it ("" for the field as a whole,
    # "[2]" for an item, ".runtime.num_replicas" for a nested key); empty when the rule holds.
    broken: Callable[[OmniStageSpec], list[str]]


def _unless(holds: Callable[[OmniStageSpec], bool]) -> Callable[[OmniStageSpec], list[str]]:
    """For rules about a field as a whole."""
    return lambda s: [] if holds(s) else [""]


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
    return any(arg == s or arg.startswith((s + "=", s + ".")) for f in OPERATOR_OWNED_FLAGS for s in _spellings(f))


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


def _owned_flag_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, a in enumerate(spec.engine.extra_args) if _literal_owned_flag(a)]


def _respelled_owned_flag_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}]" for i, a in enumerate(spec.engine.extra_args)
            if _resolves_to_owned_flag(a) and not _literal_owned_flag(a)]


def _owned_flags_cel() -> str:
    tests = [f"a == '{s}' || a.startsWith('{s}=') || a.startsWith('{s}.')"
             for f in OPERATOR_OWNED_FLAGS for s in _spellings(f)]
    return "!has(self.engine.extraArgs) || self.engine.extraArgs.all(a, !(" + " || ".join(tests) + "))"


# ---- spec.engine.env ------------------------------------------------------------------------------


def _owned_env(name: str) -> bool:
    """VLLM_PLUGINS switches the engine plugin off; OMNISTAGE_* are its switches, the resolved
    cache mode and the membership token. The operator renders all of them."""
    if name.startswith(STANDIN_ENV_PREFIX):
        return False
    return name in contract.OPERATOR_OWNED_ENV or name.startswith(OWNED_ENV_PREFIX)


def _owned_env_items(spec: OmniStageSpec) -> list[str]:
    return [f"[{i}].name" for i, e in enumerate(spec.engine.env) if _owned_env(e.name)]


def _owned_env_cel() -> str:
    names = ", ".join(f"'{n}'" for n in _OWNED_ENV_NAMES)
    return (f"!has(self.engine.env) || self.engine.env.all(e, !(e.name in [{names}]) && "
            f"(!e.name.startsWith('{OWNED_ENV_PREFIX}') || e.name.startsWith('{STANDIN_ENV_PREFIX}')))")


# ---- spec.engine.stageOverrides -------------------------------------------------------------------


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, key) of every mapping key at any depth, lists included."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            yield here, str(key)
            yield from _walk(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def _owned_stage_key(key: str) -> bool:
    # A dashed spelling of an owned key means nothing else, so it is refused too. A stage's env
    # (env:, runtime.env:) reaches its engine processes, so the operator's variables are refused.
    return key.replace("-", "_") in OPERATOR_OWNED_STAGE_KEYS or _owned_env(key)


def _owned_stage_paths(spec: OmniStageSpec) -> list[str]:
    return [path for path, key in _walk(spec.engine.stage_overrides) if _owned_stage_key(key)]


def _model_volume_one_source(spec: OmniStageSpec) -> bool:
    mv = spec.model_volume
    return mv is None or (mv.pvc is not None) + (mv.host_path is not None) == 1


_FLAGS_INSTEAD = ("the operator renders them: set spec.cache for the multimodal cache, spec.replicas for "
                  "replicas, spec.engine.httpPort/masterPort for ports and spec.engine.stageOverrides for other stage-0 keys")

SPEC_RULES = [
    Rule(
        ".cache.mode",
        "!(self.cache.mode in ['lru', 'shm'] && (self.membership == 'dynamic' || self.replicas > 1))",
        SENDER_CACHE_WITH_DYNAMIC_MEMBERSHIP,
        _unless(lambda s: not (s.cache.mode in ("lru", "shm") and membership_can_change(s.membership, s.replicas))),
    ),
    Rule(
        ".gpu.count",
        "self.gpu.count >= self.engine.tensorParallelSize",
        "spec.gpu.count must be at least spec.engine.tensorParallelSize (GPUs per replica)",
        _unless(lambda s: s.gpu.count >= s.engine.tensor_parallel_size),
    ),
    Rule(
        ".engine.masterPort",
        "self.engine.httpPort != self.engine.masterPort",
        "spec.engine.httpPort and spec.engine.masterPort must differ",
        _unless(lambda s: s.engine.http_port != s.engine.master_port),
    ),
    Rule(
        ".engine.extraArgs",
        _owned_flags_cel(),
        "spec.engine.extraArgs must not set flags the operator manages (" + ", ".join(OPERATOR_OWNED_FLAGS)
        + "; as --flag, --flag=value or --flag.key=value, with - or _); " + _FLAGS_INSTEAD,
        _owned_flag_items,
    ),
    Rule(
        ".engine.extraArgs",
        # Abbreviations and mixed spellings: see above, the operator checks.
        None,
        "spec.engine.extraArgs must not set flags the operator manages in a spelling vLLM expands "
        "(an abbreviation such as --mm-processor-cache-t, or mixed - and _); " + _FLAGS_INSTEAD,
        _respelled_owned_flag_items,
    ),
    Rule(
        ".engine.env",
        _owned_env_cel(),
        "spec.engine.env must not set variables the operator manages (" + ", ".join(_OWNED_ENV_NAMES)
        + f", {OWNED_ENV_PREFIX}*; the test stand-in's {STANDIN_ENV_PREFIX}* excepted): they switch the engine "
        "plugin off or on, set the frontend cache and carry the membership token; use spec.cache for the cache",
        _owned_env_items,
    ),
    Rule(
        ".engine.stageOverrides",
        # CEL cannot see into a preserve-unknown-fields object, so only the operator checks this.
        None,
        "spec.engine.stageOverrides must not set " + ", ".join(OPERATOR_OWNED_STAGE_KEYS)
        + f" or the operator's variables ({', '.join(_OWNED_ENV_NAMES)}, {OWNED_ENV_PREFIX}*) at any depth "
        "(e.g. runtime.num_replicas, engine_args.mm_processor_cache_type); use spec.cache and spec.replicas instead",
        _owned_stage_paths,
    ),
    Rule(
        ".modelVolume",
        "!has(self.modelVolume) || (has(self.modelVolume.pvc) ? 1 : 0) + (has(self.modelVolume.hostPath) ? 1 : 0) == 1",
        "spec.modelVolume needs exactly one of pvc or hostPath",
        _unless(_model_volume_one_source),
    ),
]

NAME_RULE_CEL = f"self.metadata.name.size() <= {MAX_NAME_LENGTH}"
NAME_RULE_MESSAGE = f"metadata.name must be at most {MAX_NAME_LENGTH} characters so the child object names fit"


class InvalidSpec(ValueError):
    """A spec the operator will not act on; `problems` are (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))


def _pydantic_problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        extra = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        out.append((f"spec.{path}" if path else "spec", f"{e['msg']}{extra}"))
    return out


def validate_omnistage(obj: dict[str, Any]) -> OmniStageSpec:
    """Parse and check an OmniStage object; raises InvalidSpec naming every offending field."""
    name = (obj.get("metadata") or {}).get("name") or ""
    problems: list[tuple[str, str]] = []
    if not name:
        problems.append(("metadata.name", "is required"))
    elif len(name) > MAX_NAME_LENGTH:
        problems.append(("metadata.name", NAME_RULE_MESSAGE))
    try:
        spec = OmniStageSpec.model_validate(obj.get("spec") or {})
    except ValidationError as err:
        raise InvalidSpec(problems + _pydantic_problems(err)) from None
    problems += [(f"spec{r.field}{part}", r.message) for r in SPEC_RULES for part in r.broken(spec)]
    if problems:
        raise InvalidSpec(problems)
    return spec
