"""What several test tiers share, in one place instead of a copy per tier: the kubectl wrapper
(kubectl.py), the one bounded poll every tier waits with (waits.py), an object's conditions and a pod's
readiness (status.py), a free TCP port (ports.py), a JSON merge patch applied as the API server applies it (patches.py), the tiny
models the real-vLLM tiers load (tiny_models.py) and changed copies of the sample OmniStage (specs.py).
Imports nothing from the tiers, so any tier, bench or script may import it. (Not to be confused with
tests/gpu/support.py, the GPU tier's own settings and install helpers.)"""
