"""One claimed step filled and published: the path of every filler that runs a StepFiller
in its own process (a reader process, reader.py, and readers=0's local reader, local.py).

The filler (fill/) is driven from here, above it; the publication is ring/publishing.py's,
below it, so that the ring never calls up into what fills it.
"""

from __future__ import annotations

import time

from ..ring.publishing import NO_STAGES, Publisher


def fill_and_publish(publisher: Publisher, filler, step: int, outputs, slot: int, after_fill=None) -> None:
    """Fills `step` into `slot` (bound as `outputs`) with `filler` and publishes it; an
    exception leaves the slot unpublished (FILLING), for the caller to hand back.
    `after_fill`: called between the fill and the publication (a reader's fork check)."""
    # Slot s only ever holds steps k with k % slot_count == s (Ring.publish checks the rest
    # of the precondition: the slot is FILLING by this publisher's record).
    assert step % publisher.ring.layout.slot_count == slot, (step, slot)
    started = time.perf_counter_ns()
    records = getattr(filler, "skipped", ())  # A test's stand-in filler may keep none.
    known = len(records)
    filler.fill(step, outputs)
    if after_fill is not None:
        after_fill()
    skipped = [record.to_dict() for record in records[known:]]
    # The filler's time by stage, summed over its fills (StepFiller.stage_ns; a test's stand-in keeps none).
    publisher.publish(slot, time.perf_counter_ns() - started, skipped, getattr(filler, "stage_ns", NO_STAGES))
