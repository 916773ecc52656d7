"""vLLM plugin that makes a replicated, elastic stage 0 safe in vllm-omni 0.30.0.

Loaded through the `vllm.general_plugins` entry point in every vLLM process (head, headless
launchers, engine cores, workers). Each patch checks its target and becomes a logged no-op
when upstream already has the fix or the target changed shape.
"""

from __future__ import annotations


def apply() -> None:
    """Entry point for `vllm.general_plugins`: idempotent and cheap."""
    # Imported lazily so that loading the plugin in a worker costs nothing until it runs.
    from . import patches

    patches.apply_all()
