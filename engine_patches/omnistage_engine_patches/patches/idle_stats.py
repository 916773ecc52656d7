"""Patch ``idle_stats``: the scheduler's last stats before it goes idle are never throttled away.

Defect (vllm-omni 0.30.0 and 0.32.0rc1): ``OmniSchedulerMixin.make_stats``
(core/sched/omni_scheduler_mixin.py) returns None when the previous ``SchedulerStats`` are less
than ``_STATS_INTERVAL_S`` (1 s) old. vLLM sends stats only with a step's outputs, and an engine
with no request left takes no step. So the step that empties the scheduler (the last request
finished, or the ones a client gave up on aborted) is usually inside the interval: its stats are
dropped, no later step sends others, and the head's ``vllm:num_requests_running`` /
``num_requests_waiting`` / KV-usage gauges for that engine keep their last busy values for as
long as it stays idle. Autoscalers read those series. Seen from outside: after a stall of the
head's engine whose requests were aborted, ``num_requests_running{replica="0"}`` stayed at 2, then
1, with nothing in flight.

The wrapper: when the throttle returned None and the scheduler holds no unfinished request, it
makes the stats anyway (vLLM's own ``make_stats``) and restarts the interval. A busy engine is
throttled exactly as upstream; an idle one takes no step, so this adds at most one stats batch per
"busy -> idle" change.

Switch off: ``OMNISTAGE_DISABLE_PATCHES=idle_stats`` (the negative control).
"""

from __future__ import annotations

import time
from typing import Any

from .. import contract
from .._patching import Target, UpstreamFixed, ours, shape_problem, wrap

NAME = contract.IDLE_STATS
THROTTLE = "_STATS_INTERVAL_S"  # the mixin module's interval; gone means upstream stopped throttling


def install() -> str | None:
    from vllm_omni.core.sched import omni_scheduler_mixin as mixin

    target = Target(mixin.OmniSchedulerMixin, "make_stats")
    if (problem := shape_problem(target)) is not None:
        return problem
    if ours(NAME, target):
        return None
    if not hasattr(mixin, THROTTLE):
        return UpstreamFixed(f"omni_scheduler_mixin has no {THROTTLE}: stats are not throttled")

    @wrap(mixin.OmniSchedulerMixin, "make_stats", NAME)
    def make_stats(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        stats = original(self, *args, **kwargs)
        if stats is not None or self.get_num_unfinished_requests():
            return stats
        # The step that left the scheduler empty: its stats are the last the head gets.
        self._last_stats_time = time.monotonic()
        return super(mixin.OmniSchedulerMixin, self).make_stats(*args, **kwargs)

    return None
