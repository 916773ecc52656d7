"""Patch ``registration_report``: a headless replica tells the head its patch outcomes when it registers.

The head reports its own outcomes at ``contract.ENGINE_PATH``; a headless replica process (a
stage-0 replica, or a pool pod's ``vllm serve --omni --headless --stage-id K``) loads the same
plugin but serves no HTTP, so nobody could see whether e.g. ``connector_ports`` applied there.
Its one message to the head is the registration (vllm-omni 0.30.0,
``engine/stage_engine_startup.py``): ``register_stage_with_omni_master`` msgpack-encodes
``{"stage_id", "replica_id", "stage_config": _serialize_stage_config(omni_stage_config), ...}``
and the head's ``OmniMasterServer`` stores the decoded ``stage_config`` as it came, in
``_stage_configs[(stage_id, replica_id)]``.

The wrapper adds one key, ``contract.REGISTRATION_PATCHES_KEY``, to that stage config: ``{patch
name: outcome}`` of ``_patching.outcomes()`` in the registering process, read at call time. The
plugin is in place by then: vllm-omni's ``run_headless`` (entrypoints/cli/serve.py) builds the
replica's ``VllmConfig`` before ``launch_headless_llm_replicas``, and ``EngineArgs.__post_init__``
runs vLLM's ``load_general_plugins``. Nothing else is changed. A dict config is copied with the key added;
any other config is first serialized by vllm-omni's own ``_serialize_stage_config`` (what the
original does to it anyway, so the head receives the same value) and gets the key when that gives
a dict; otherwise (``None``, no serializer) it is sent unchanged. ``None`` in particular stays
``None``: the head rejects an initial slot registered without a stage config, and that stays so.

Only registrations that ask the master to assign the replica id (``replica_id=None``) carry the
report: in 0.30.0 those are exactly the headless launchers' (``launch_headless_llm_replica``,
``launch_headless_diffusion_replica``). The head registers its own local replicas with their
planned id (``_launch_omni_core_engines``, ``launch_diffusion_stage_replica``) and reports its
outcomes at ``contract.ENGINE_PATH`` already, so the head-local member carries none.

Why the extra key is harmless on the head (0.30.0): the stored config is read in one place,
``DistStageRuntime._initialize_remote_replica``, which only checks it is not None ("Registration is
transport-only: the head-side typed plan remains authoritative"); a dynamic replica's
``on_register`` callback (``_dispatch_master_register``) passes only (stage id, replica id) on to
``MembershipController``, and the master itself only tests which keys of ``_stage_configs`` exist
(``_next_free_replica_id``). The membership listing (:mod:`.membership_ops`) reads the key back as
the member's ``"patches"``.

The callers look the function up in ``stage_engine_startup``'s globals at call time; install
checks that every caller listed in ``CALLERS`` still does, and puts the wrapper in each globals
dict they use, so the wrapper is really what they call. A module that bound the function with
``from ... import`` before the plugin loaded keeps the original (none in vllm-omni 0.30.0).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from .. import contract
from .._patching import Target, demote, ours, outcomes, shape_problem, wrap

NAME = contract.REGISTRATION_REPORT
KEY = contract.REGISTRATION_PATCHES_KEY
FUNCTION = "register_stage_with_omni_master"
SERIALIZER = "_serialize_stage_config"
#: The headless launchers that call FUNCTION, by name in stage_engine_startup.
CALLERS = ("launch_headless_llm_replica", "launch_headless_diffusion_replica")
#: Keyword-only parameters the wrapper reads.
PARAMS = ("omni_stage_config", "replica_id")

logger = logging.getLogger("omnistage_engine_patches")


def report() -> dict[str, str]:
    """What a registration carries: every recorded patch outcome of this process."""
    return {name: o.outcome for name, o in sorted(outcomes().items())}


def with_report(stage_config: Any, serialize: Any = None) -> Any:
    """``stage_config`` with the report added, or unchanged when it cannot carry one (see the
    module docstring). The caller's object is never modified."""
    if stage_config is not None and not isinstance(stage_config, dict) and callable(serialize):
        stage_config = serialize(stage_config)
    if not isinstance(stage_config, dict):
        return stage_config
    return {**stage_config, KEY: report()}


def reported(stage_config: Any) -> dict[str, str] | None:
    """The report a registered stage config carries (head side), or None: no report (an old plugin,
    the patch off, the head's own replica) or one not of the expected shape."""
    if not isinstance(stage_config, Mapping):
        return None
    value = stage_config.get(KEY)
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        return None
    return dict(value)


def install() -> str | None:
    from vllm_omni.engine import stage_engine_startup as module

    target = Target(module, FUNCTION)
    problem = shape_problem(target)
    if problem:
        return problem
    if ours(NAME, target):
        return None
    original = target.get()
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError) as e:
        return f"cannot read the signature of {FUNCTION} ({e})"
    for name in PARAMS:
        if name not in params or params[name].kind is not inspect.Parameter.KEYWORD_ONLY:
            return f"{FUNCTION} changed shape ({name} is not a keyword-only parameter)"
    bindings: list[dict[str, Any]] = [vars(module)]  # callers that go through the module attribute
    for caller in CALLERS:  # check every binding before changing any
        fn = getattr(module, caller, None)
        namespace = getattr(fn, "__globals__", None)
        if namespace is None:
            return f"stage_engine_startup.{caller} is gone (the headless registration moved)"
        if namespace.get(FUNCTION) is not original:
            return f"{caller} does not call stage_engine_startup.{FUNCTION} through its module globals"
        if not any(namespace is b for b in bindings):
            bindings.append(namespace)

    @wrap(module, FUNCTION, NAME)
    def register_stage_with_omni_master(original: Any, *args: Any, **kwargs: Any) -> Any:
        # replica_id=None: a headless launcher asking the master for an id (module docstring).
        if not args and "replica_id" in kwargs and kwargs["replica_id"] is None:
            try:
                kwargs["omni_stage_config"] = with_report(kwargs.get("omni_stage_config"),
                                                          getattr(module, SERIALIZER, None))
            except Exception as err:  # noqa: BLE001  (the registration goes out whatever the report does)
                logger.warning(
                    "patch %s: registering without the report (%s: %s)", NAME, type(err).__name__, err
                )
                demote(NAME, f"building the report failed ({type(err).__name__}: {err})")
        return original(*args, **kwargs)

    for namespace in bindings[1:]:  # the module's own is wrapped already
        namespace[FUNCTION] = vars(module)[FUNCTION]
    return None

