"""What several test tiers share, in one place instead of a copy per tier: the kubectl wrapper
(kubectl.py), the one bounded poll every tier waits with (waits.py), an object's conditions and a pod's
readiness (status.py), a free TCP port (ports.py), a JSON merge patch applied as the API server applies
it (patches.py), the tiny models the real-vLLM tiers load (tiny_models.py), changed copies of the sample
OmniStage (specs.py), the repository's root, the sample and hack/ scripts (repo.py), the engine tier's
process (engine_env.py), its stage-0 engine and stood-in replicas (engine_stack.py), loopback addresses
(loopback.py), and a cluster test's namespace and a container's environment as its pod has it
(cluster.py). Tests import these, never a conftest (tests/unit/test_no_conftest_imports.py). Imports
nothing from the tiers, so any tier, bench or script may import it. (Not to be confused with
tests/gpu/support.py, the GPU tier's own settings and install helpers.)"""
