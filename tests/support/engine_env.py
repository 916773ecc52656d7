"""The engine tier's process: the environment every real-vLLM test needs and the plugin loaded
through vLLM's own loader. Importing this module sets the environment, then imports vllm_omni (its
import applies vllm-omni's own class patches): import it before anything imports vLLM (the engine
tier's conftest and tests/bench/bench_cache.py do, first).

* the environment: loopback only, offline hub, no usage stats (loopback.LOOPBACK_ENV, forced whatever
  the caller's environment says), the plugin allow-list, a shared-memory ring name of this process's;
* `VLLM_OMNI_IMPORT_ERROR`: why vllm_omni could not be imported, or None;
* `load_engine_patches()`: this project's patches applied through vLLM's real plugin loader
  (`vllm.plugins.load_general_plugins` with `VLLM_PLUGINS` naming our entry point), so
  `OMNISTAGE_DISABLE_PATCHES=name` in the process's environment switches a patch off for the whole
  run: that is how the negative controls run;
* `patch_applied(name)`: whether a patch is in effect in this process.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from tests.support.loopback import LOOPBACK_ENV

os.environ.update(LOOPBACK_ENV)
# Plugins loaded by vLLM's loader: ours, and vllm-omni's own registration (which must be listed
# whenever VLLM_PLUGINS is set). Engine-tier modules that need more may extend ENGINE_PLUGINS.
ENGINE_PLUGINS = ["omnistage_engine_patches", "vllm_omni_register_models"]
_listed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys(_listed + ENGINE_PLUGINS))
# vLLM names its shared-memory multimodal ring per process tree; keep test runs apart.
os.environ.setdefault("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", f"omnistage_test_{uuid.uuid4().hex[:12]}")

try:
    import vllm_omni  # noqa: F401  (its import applies vllm-omni's own class patches)

    VLLM_OMNI_IMPORT_ERROR: str | None = None
except Exception as e:  # noqa: BLE001  (ImportError, or a broken install raising anything)
    VLLM_OMNI_IMPORT_ERROR = f"{type(e).__name__}: {e}"


def load_engine_patches() -> dict[str, Any]:
    """Load the general plugins the way every vLLM process does; return the patch outcomes.

    vLLM loads plugins once per process. If something in this process already loaded them (before
    VLLM_PLUGINS named us), call the same entry point our plugin registers."""
    from importlib.metadata import entry_points

    import vllm.plugins as vllm_plugins
    from omnistage_engine_patches import _patching

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    assert "omnistage_engine_patches" in names, (
        "the omnistage_engine_patches entry point is not installed: run hack/setup.sh (pip install -e .)"
    )
    if getattr(vllm_plugins, "plugins_loaded", False):
        import omnistage_engine_patches

        omnistage_engine_patches.apply()
    else:
        vllm_plugins.load_general_plugins()
    return _patching.outcomes()


def patch_applied(name: str) -> bool:
    """Whether the named patch is in effect in this process."""
    from omnistage_engine_patches import _patching

    outcome = _patching.outcomes().get(name)
    return bool(outcome and outcome.applied)
