"""Continuous batching as small managers, each owning its state; :class:`Scheduler` composes them.

==============  ==============================================================================
scheduler.py    the step (schedule, run, process), the request table, finishing a request
waiting.py      the waiting queue and request admission: what can ever run, in what order
deadlines.py    request timeouts: the nearest deadline first, checked once a step
prefill.py      prefill steps: the step's budget, prefix reuse, chunking (one partial prompt)
running.py      the running batch: decoding requests, their sampling rows, leavers
retraction.py   decode short of KV: whom to send back to the queue; preemption by priority
reserve.py      the admission reserve: the adaptive share of running requests' output kept free
pipeline.py     the device side: launch a step, read its tokens back (copy stream), the step in flight
run_ahead.py    overlap: the next step that can be queued before the one in flight is read
reporting.py    the outputs of a step: new tokens, finishes, refusals
batch.py        one scheduled step; limits.py: the limits every manager reads
==============  ==============================================================================

Where what comes next goes: a queue bound, priorities and the order of admission (fcfs,
longest prefix match) in waiting.py; preemption and swapping KV to host memory in retraction.py; counters, histograms and
a periodic batch log line in reporting.py and ``Scheduler.stats``.
"""

from app.engine.scheduling.limits import SchedulerLimits
from app.engine.scheduling.scheduler import Scheduler, SchedulerStats
from app.engine.scheduling.waiting import AdmissionError, QueueFullError

__all__ = ["AdmissionError", "QueueFullError", "Scheduler", "SchedulerLimits", "SchedulerStats"]
