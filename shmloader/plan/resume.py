"""Where a checkpoint continues: the sampler (a resharded dealing, a shifted start), its pass
and the step (or resumed position) to go on from. Plain planning over the stream's
geometry: the loader's load_state_dict asks this, then has its session fill with it."""

from __future__ import annotations

import dataclasses

from .checkpoint import PASS_ENDED, Resume, step_to_resume
from .passes import ENDLESS, FinitePass


@dataclasses.dataclass(frozen=True)
class Continuation:
    """The sampler and pass to fill with, and where: `step` (a plain step), or `resume` (a
    step whose first rows, before resume.position, were delivered before the checkpoint)."""

    sampler: object
    finite: FinitePass | None
    step: int
    resume: Resume | None = None

    @property
    def end_step(self) -> int:
        return ENDLESS if self.finite is None else self.finite.steps


def _shift_delivers(sampler, transition, start: int, epochs: int, drop_last: bool) -> bool:
    """Whether the pass shifted to `start` has a step left to deal (FinitePass refuses one
    that holds no row, or with drop_last fewer rows than a step across the shards)."""
    shifted = sampler.with_transition(None).with_start(start).with_transition(transition)
    try:
        FinitePass.of(shifted, epochs, drop_last)
    except ValueError:
        return False
    return True


def _pass_end(sampler, epochs: int, drop_last: bool) -> int:
    """The stream position where a pass ends for every shard: where shards read their own
    streams, the longest one's end (a dealt tail gives the others rows of it)."""
    finite = FinitePass.of(sampler, epochs, drop_last)
    if not finite.own_streams:
        return finite.positions
    return max(sampler.pass_positions(epochs, index) for index in range(sampler.shard_count))


def _start_of(resume, sampler) -> int:
    """Where a resumed stream starts (Sampler.start_position, plan/checkpoint.py Resume): 0
    for a resume by step, or where the resumed step is cut instead (a mixture)."""
    if isinstance(resume, Resume) and resume.start is not None and sampler.fills_positions:
        return resume.start
    return 0


def continuation(state: dict, sampler, finite: FinitePass | None, sources: list[dict], transform,
                 epochs: int | None, drop_last: bool) -> Continuation:
    """Where `state` (a state_dict()) continues for a loader filling with `sampler` and its
    pass `finite` (see ShmDataLoader.load_state_dict for what that means for each shape of
    change); raises, naming what changed, for a checkpoint of other sources or settings."""
    resume, transition = step_to_resume(state, sampler, sources, transform, finite)
    current = sampler
    # A checkpoint at or past the end of its pass (in this shape too) ends this pass: its
    # stream is not shifted there, where no step would be left to deal.
    unshifted = sampler if transition == sampler.transition else sampler.with_transition(transition)
    ended = resume is PASS_ENDED or (isinstance(resume, Resume) and epochs is not None and
                                     resume.position >= _pass_end(unshifted, epochs, drop_last))
    start = 0 if ended else _start_of(resume, sampler)
    if start and epochs is not None and not _shift_delivers(sampler, transition, start, epochs, drop_last):
        ended, start = True, 0  # drop_last: fewer rows left than a global batch, dropped: the pass ends here.
    if transition != current.transition or start != sampler.start_position:  # Checked whole.
        if start != sampler.start_position:  # Set without the dealing, which it shifts.
            sampler = sampler.with_transition(None).with_start(start)
        sampler = sampler.with_transition(transition)
        finite = None if epochs is None else FinitePass.of(sampler, epochs, drop_last)
    end = ENDLESS if finite is None else finite.steps
    if start:  # The shifted stream's step starts at the position: nothing to cut (its pass ends there at the
        resume = resume.step  # latest, on every shard alike).
    elif ended or resume is PASS_ENDED or (isinstance(resume, Resume) and finite is not None and
                                          resume.position >= finite.positions):
        resume = end  # The checkpoint's pass had ended (its last global batch ran past it): so has this one.
    if not isinstance(resume, Resume):
        return Continuation(sampler, finite, resume)
    return Continuation(sampler, finite, resume.step, resume)
