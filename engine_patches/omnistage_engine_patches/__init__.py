"""vLLM plugin that makes a replicated, elastic stage 0 safe in vllm-omni 0.30.0.

Loaded through the `vllm.general_plugins` entry point in every vLLM process (head, headless
launchers, engine cores, workers). Each patch checks its target and records an outcome
(applied, skipped with its reason, disabled, or upstream-fixed); nothing here ever raises into
vLLM's plugin loader. The head reports the outcomes at `contract.ENGINE_PATH`; a headless
replica sends its own with its registration, and the head lists them per member
(`registration_report`).
"""

from __future__ import annotations

import contextlib
import logging


def apply() -> None:
    """Entry point for `vllm.general_plugins`: idempotent, and never raises."""
    try:
        # Imported lazily so that loading the plugin in a worker costs nothing until it runs.
        from . import patches

        patches.apply_all()
    except Exception:
        logging.getLogger("omnistage_engine_patches").exception("engine patches failed to load")
        with contextlib.suppress(Exception):  # record what we can: the report shows it as skipped
            from . import _patching, contract

            for name in contract.PATCHES:
                _patching.apply_patch(name, lambda: "the plugin failed to load (see the head's log)")
