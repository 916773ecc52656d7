"""The decision, pure: what a pass observed (actions.Observed) in, the actions and the status out
(plan.plan). Imports nothing from runtime/ and no I/O library (tests/unit/test_layers.py)."""
