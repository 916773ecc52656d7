#!/usr/bin/env python3
"""Each engine patch's outcome in this Python's vLLM and vllm-omni, without starting an engine.

Loads the plugin the way every vLLM process does (`vllm.plugins.load_general_plugins`, with
VLLM_PLUGINS naming this project's two entry points) and prints one line per patch: its outcome and
the reason; then the endpoint plugins vLLM would attach to its HTTP app. The static half of
docs/engine-versions.md:

    OMNISTAGE_ENGINE_VERSION=0.32 bash hack/real-engine-env.sh
    ~/.cache/omnistage/venv-cpu-0.32/bin/python hack/patch-outcomes.py

Imports vLLM (seconds to minutes on a busy machine); serves nothing, binds nothing.
"""

from __future__ import annotations

import logging
import os


def main() -> None:
    os.environ.setdefault("VLLM_PLUGINS", "omnistage_engine_patches,omnistage_membership")
    logging.basicConfig(level=logging.ERROR)
    import vllm
    import vllm.plugins
    import vllm_omni
    from omnistage_engine_patches import _patching, contract

    vllm.plugins.load_general_plugins()
    print(f"vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__}")
    outcomes = _patching.outcomes()
    for name in contract.PATCHES:
        o = outcomes.get(name)
        print(f"{name:22s} {o.outcome if o else 'not loaded':15s} {o.reason if o else ''}")
    plugins = vllm.plugins.load_endpoint_plugins(("generate",))
    print("endpoint plugins:", ", ".join(type(p).__name__ for p in plugins) or "none")


if __name__ == "__main__":
    main()
