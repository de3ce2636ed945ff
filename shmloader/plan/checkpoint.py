"""Checkpoints: what state_dict() records and the checks load_state_dict() makes before it
continues (a checkpoint of other data, settings or transform is refused, saying what)."""

from __future__ import annotations

import collections.abc
import dataclasses

from .geometry import StreamGeometry
from .passes import FinitePass
from .reshard import _TRANSITION_KEYS, Origin, Transition, transition_of
from .sampler import Sampler


# What a checkpoint's "position" counts: positions of the global stream every shard reads
# a block of each step ("global"), or of each shard's own stream (a shuffle window split
# among shards: "shard").
GLOBAL, SHARD = "global", "shard"
# step_to_resume's answer for a checkpoint whose finite pass had ended (under another
# shard count with a window, where no dealing is made for it).
PASS_ENDED = "pass ended"

# Settings a checkpoint may be loaded under with other values: the position it names is
# continued (elastic resume).
ELASTIC_SETTINGS = ("batch_size", "shard_count", "shard_index")
# The sampler's dealing of a resharded checkpoint: compared on its own (step_to_resume);
# where an elastic resume started its run: a loader starts its own from the position.
_NOT_COMPARED = ("transition", "start_position")


def position_of(sampler: StreamGeometry, next_step: int) -> tuple[int, str]:
    """(position, kind): where the stream stands before `next_step`, the same on every
    shard (each shard's next step is the same): the start of its global batch, or of the
    shard's own batch where each shard reads its own stream (shifted by a resume's offset)."""
    return sampler.step_position(next_step), SHARD if sampler.shard_blocks else GLOBAL


@dataclasses.dataclass(frozen=True)
class Resume:
    """A checkpoint continued under another batch size or shard count: the stream goes on
    from `position`; `step` is the new numbering's step holding it. With `start` the
    sampler's stream starts there (Sampler.start_position: the step starts at `position`,
    whole); without (a mixture, or a checkpoint from before start positions were recorded)
    the rows of `step` before `position` are cut (a first, shorter step)."""

    position: int
    kind: str
    step: int
    start: int | None = None


def state_of(next_step: int, sampler: StreamGeometry, sources: list[dict], transform, finite=None,
             position: int | None = None) -> dict:
    """The next step to deliver, the position it stands at (`position` when a resume's
    first step is still ahead), the sampler's settings, the sources' description, and a
    finite pass's epochs and drop_last."""
    found, kind = position_of(sampler, next_step)
    state = {"step": next_step, "position": max(found, position or 0), "position_kind": kind, **sampler.to_dict(),
             "sources": sources}
    if finite is not None:
        state.update(finite.to_dict())
    if transform is not None:
        state["transform"] = {"name": transform.name, "args": transform.args}
    if sampler.shuffle_window is not None:
        state["shuffle_order"] = sampler.shuffle_order
    if sampler.deals_on_reshard:  # Recorded when None too: a checkpoint that lacks the key was edited (or is older).
        state.setdefault("transition", None)
    return state


def step_to_resume(state, sampler: StreamGeometry, sources: list[dict], transform, finite=None):
    """The step `state` continues from, once it is this loader's checkpoint."""
    if not isinstance(state, collections.abc.Mapping):
        raise TypeError(f"state must be the mapping state_dict() returned, got {type(state).__name__}")
    _check_scalars(state)
    # Settings added after a checkpoint format was first written are optional at their defaults.
    missing = sorted({"step", "sources", *sampler.to_dict()} -
                     {"shuffle_window", "block_rows", "epochs", "drop_last", *_NOT_COMPARED} - set(state))
    if missing:
        raise ValueError(f"the checkpoint lacks {missing}: without them nothing checks that its batches are this "
                         f"loader's. Pass the whole state_dict(), or call seek(step) to jump without checks")
    if not isinstance(state["sources"], list) or not all(isinstance(item, dict) for item in state["sources"]):
        raise ValueError(f"the checkpoint's sources must be a list of dicts (as state_dict() gives), got "
                         f"{state['sources']!r}")
    if state["sources"] != sources:
        raise ValueError(f"the checkpoint was made from other data: {_sources_change(state['sources'], sources)}")
    mine = None if transform is None else {"name": transform.name, "args": transform.args}
    if state.get("transform") != mine and ("transform" in state or mine is not None):
        raise ValueError(f"the checkpoint was made with transform {state.get('transform')!r}, this loader has "
                         f"{mine!r}; its batches would differ")
    if sampler.shuffle_window is not None and state.get("shuffle_window") is not None and \
            state.get("shuffle_order") != sampler.shuffle_order:
        before = state.get("shuffle_order")
        what = ("whose block-local shuffle dealt whole windows one after another (no shuffle_order recorded)"
                if before is None else f"whose order was {before!r}")
        raise ValueError(f"the checkpoint was made with shuffle_window={state['shuffle_window']!r} by a shmloader "
                         f"{what}; this one's is {sampler.shuffle_order!r} (a window that covers the data is the "
                         f"global shuffle now), so its steps name other rows. Resume it with the shmloader that wrote "
                         f"it, or seek(step) to continue in this order")
    expected = {**{key: value for key, value in sampler.to_dict().items() if key not in _NOT_COMPARED},
                **({"epochs": None, "drop_last": None} if finite is None else finite.to_dict())}
    mismatched = {key: (_recorded(state, key), value) for key, value in expected.items()
                  if _recorded(state, key) != value}
    elastic = {key for key in mismatched if key in ELASTIC_SETTINGS}
    fixed = {key: values for key, values in mismatched.items() if key not in ELASTIC_SETTINGS}
    if fixed:
        details = ", ".join(f"{key}: checkpoint {saved!r}, loader {mine!r}" for key, (saved, mine) in fixed.items())
        raise ValueError(f"the checkpoint was made with other settings ({details}); its batches would differ")
    # A dealing the checkpoint's run was making (a resharded resume of its own): it goes on
    # as it was under the same shard count.
    dealt = _checked_transition(state, sampler, finite)
    if elastic - {"shard_index"}:
        _refuse_in_tail(state, sampler, dealt, finite)
    if "shard_count" in elastic and sampler.deals_on_reshard:
        return _resharded(state, sampler, dealt, finite)
    if not elastic - {"shard_index"}:  # The same global batches: the same step (shards may swap indices),
        step = state.get("step")       # or the rows from the position where a resumed first step is ahead.
        global_batch = sampler.global_batch
        _checked_position(state, sampler)  # A step and position that disagree name no place to resume.
        position, kind = state.get("position"), state.get("position_kind", GLOBAL)
        start = _checked_start(state, global_batch)
        if start:  # The run's own resumed stream, continued as it was.
            return Resume(position, kind, step, start), dealt
        if isinstance(step, int) and isinstance(position, int) and 0 < position - step * global_batch < global_batch:
            return Resume(position, kind, step), dealt
        return step, dealt
    return _elastic(state, sampler, elastic), dealt


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The scalar keys a checkpoint may hold: what each must be, checked before any is compared
# or computed with (a '7' or 7.0 for a step, or a bool for a count, would otherwise reach
# arithmetic and comparisons: a raw TypeError, or a float taken as a step).
_SCALARS = {
    "step": ("a non-negative integer", lambda value: _is_int(value) and value >= 0),
    "position": ("a non-negative integer", lambda value: _is_int(value) and value >= 0),
    "position_kind": (f"{GLOBAL!r} or {SHARD!r}", lambda value: value in (GLOBAL, SHARD)),
    "length": ("a positive integer", lambda value: _is_int(value) and value >= 1),
    "batch_size": ("a positive integer", lambda value: _is_int(value) and value >= 1),
    "shard_count": ("a positive integer", lambda value: _is_int(value) and value >= 1),
    "shard_index": ("a non-negative integer", lambda value: _is_int(value) and value >= 0),
    "seed": ("a non-negative integer", lambda value: _is_int(value) and value >= 0),
    "mode": ("a string", lambda value: isinstance(value, str)),
    "shuffle_window": ("None or a positive integer", lambda value: value is None or _is_int(value) and value >= 1),
    # A mixture's: one per source, or None without a window.
    "block_rows": ("a positive integer (a mixture's: None or a list of them)",
                   lambda value: value is None or _is_int(value) and value >= 1 or
                   isinstance(value, list) and all(_is_int(rows) and rows >= 1 for rows in value)),
    "epochs": ("None or a positive integer", lambda value: value is None or _is_int(value) and value >= 1),
    "drop_last": ("None or a bool", lambda value: value is None or isinstance(value, bool)),
    "shuffle_order": ("a string", lambda value: isinstance(value, str)),
    "start_position": ("a non-negative integer", lambda value: _is_int(value) and value >= 0),
}


def _check_scalars(state) -> None:
    """Refuses a scalar key of the wrong type or range, naming it and what was expected."""
    for key, (expected, valid) in _SCALARS.items():
        if key in state and not valid(state[key]):
            raise ValueError(f"the checkpoint's {key} must be {expected}, got {state[key]!r}; pass the state_dict() "
                             f"as it was")
    index, count = state.get("shard_index"), state.get("shard_count")
    if _is_int(index) and _is_int(count) and index >= count:
        raise ValueError(f"the checkpoint's shard_index must be below its shard_count ({count}), got {index}; pass the "
                         f"state_dict() as it was")


def _checked_transition(state, sampler, finite) -> Transition | None:
    """The checkpoint's transition (a resharded resume's dealing), or None: dealt again
    from the origin it records and compared key by key, its start not after the
    checkpoint's own position. A windowed checkpoint records the key even where it is None,
    so that one whose dealing was removed is refused rather than read as undealt."""
    if "transition" not in state:
        if sampler.deals_on_reshard:
            raise ValueError("the checkpoint records no transition (a checkpoint of a shuffle window smaller than the "
                             "data records one, None where its run was not resharded): it was edited, or written by a "
                             "shmloader from before resharded dealings. If its run never changed its shard count, add "
                             "\"transition\": None to it; otherwise resume the checkpoint it was resumed from")
        return None
    if state["transition"] is None:
        return None
    if not sampler.deals_on_reshard:
        raise ValueError(f"the checkpoint has a transition (a resharded dealing), which only a shuffle window smaller "
                         f"than the data and no mixture makes; this loader's stream has none. Got "
                         f"{state['transition']!r}; pass the state_dict() as it was")
    dealt = Transition.from_dict(state["transition"])
    origin = dealt.origin
    if origin is None:
        raise ValueError("the checkpoint's transition has no origin (the checkpoint it was dealt from), so nothing "
                         "checks its positions and start: it was edited, or written by a shmloader from before "
                         "transitions recorded it. Resume the checkpoint it was resumed from")
    try:  # The new run's stream as it resumed: its shard count, the origin's batch size.
        resumed = Sampler(sampler.length, origin.batch_size, sampler.mode, sampler.seed, 0, state["shard_count"],
                          sampler.shuffle_window, sampler.block_rows)
        expected = transition_of(resumed, origin, None if finite is None else finite.epochs)
    except ValueError as error:
        raise ValueError(f"the checkpoint's transition.origin deals no transition: {error}") from None
    differ = [f"transition.{key} is {getattr(dealt, key)!r}, its origin deals {getattr(expected, key)!r}"
              for key in _TRANSITION_KEYS if getattr(dealt, key) != getattr(expected, key)]
    if differ:
        raise ValueError(f"the checkpoint's transition disagrees with the origin it records (position "
                         f"{origin.position} of {origin.shard_count} shards, resumed at batch_size "
                         f"{origin.batch_size}): {'; '.join(differ)}. Pass the state_dict() as it was")
    position, _ = _checked_position(state, sampler)
    if position < dealt.start:
        raise ValueError(f"the checkpoint's position {position} is before its transition.start {dealt.start} (the "
                         f"first position of the step its run resumed at): no run that dealt it stood there. Resume "
                         f"the checkpoint it was resumed from and seek() from there")
    return dealt


def _recorded_sampler(state, sampler, dealt: Transition | None) -> Sampler:
    """The sampler of the run that wrote `state` (its shape, dealing and start), over this
    loader's data: what its pass was."""
    start = state.get("start_position", 0)
    if _is_int(state.get("position")) and start > state["position"]:
        raise ValueError(f"the checkpoint's start_position {start} is after its position {state['position']}: its "
                         f"run cannot have started past where it stands. Pass the state_dict() as it was")
    return Sampler(sampler.length, state["batch_size"], sampler.mode, sampler.seed, 0, state["shard_count"],
                   sampler.shuffle_window, sampler.block_rows, dealt, start_position=start)


def _refuse_in_tail(state, sampler: StreamGeometry, dealt: Transition | None, finite) -> None:
    """Refuses, under another batch size or shard count, a checkpoint taken within the
    dealt tail of its pass (passes.py): part of the tail was delivered, its rows from every
    shard's stream, so no single position says which rows are left. (A mixture's pass has
    no tail.)"""
    if finite is None or not sampler.fills_positions or not _is_int(state.get("step")):
        return
    recorded_pass = FinitePass.of(_recorded_sampler(state, sampler, dealt), finite.epochs, finite.drop_last)
    if recorded_pass.in_tail(state["step"]):
        tail = recorded_pass.tail
        shards, batch = state["shard_count"], state["batch_size"]
        raise ValueError(f"the checkpoint was taken at step {state['step']}, within the last {tail.steps} steps of its "
                         f"pass (from step {tail.first_step}), whose rows are dealt evenly among its {shards} shards; "
                         f"it continues only with shard_count={shards} and batch_size={batch}. Change them at a "
                         f"checkpoint before step {tail.first_step + 1}, or resume it as it was")


def _checked_position(state, sampler: StreamGeometry) -> tuple[int, str]:
    """The checkpoint's position and its kind, checked against its step."""
    if "position" in state:
        position, kind = state["position"], state.get("position_kind", GLOBAL)
    else:  # Written before positions were recorded: the same arithmetic, from its own settings.
        step, batch, shards = state["step"], state["batch_size"], state["shard_count"]
        kind = SHARD if state.get("shuffle_window") is not None and shards > 1 and sampler.blocks_per_window else GLOBAL
        position = step * batch * (1 if kind == SHARD else shards)
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise ValueError(f"the checkpoint's position must be a non-negative integer, got {position!r}")
    step, batch, shards = state.get("step"), state.get("batch_size"), state.get("shard_count")
    if all(isinstance(value, int) for value in (step, batch, shards)):
        recorded_batch = batch * (1 if kind == SHARD else shards)
        if not step * recorded_batch <= position < (step + 1) * recorded_batch:
            raise ValueError(f"the checkpoint's step {step} and position {position} disagree (a step of its "
                             f"{recorded_batch} positions holds {step * recorded_batch} to "
                             f"{(step + 1) * recorded_batch - 1}); pass the state_dict() as it was")
    return position, kind


def _resharded(state, sampler, dealt: Transition | None, finite) -> tuple[int, Transition]:
    """A checkpoint of a shuffle window split among shards (or of one host's window),
    continued under another shard count: the dealing of its unread rows (reshard.py), from
    the step of this loader's numbering that holds its position."""
    position, _ = _checked_position(state, sampler)
    old_count, old_batch = state["shard_count"], state["batch_size"]
    for name, value in (("shard_count", old_count), ("batch_size", old_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"the checkpoint's {name} must be a positive integer, got {value!r}")
    if finite is not None:  # A finished pass stays finished: its dropped rows are not dealt again.
        recorded = _recorded_sampler(state, sampler, dealt)
        if state["step"] >= FinitePass.of(recorded, finite.epochs, finite.drop_last).steps:
            return PASS_ENDED, None
    step = position // sampler.batch_size
    origin = Origin(position, old_count, sampler.batch_size, None if dealt is None else dealt.without_origin())
    return step, transition_of(sampler, origin, None if finite is None else finite.epochs)


def _elastic(state, sampler: StreamGeometry, changed: set) -> Resume:
    """Where a checkpoint taken under another batch size or shard count continues here."""
    position, kind = _checked_position(state, sampler)
    mine = SHARD if sampler.shard_blocks else GLOBAL
    if kind != mine:
        raise ValueError(f"the checkpoint's position counts {kind!r} stream positions and this loader's count "
                         f"{mine!r} ones, with the same settings otherwise; pass the state_dict() as it was")
    return Resume(position, kind, position // sampler.global_batch, position if sampler.fills_positions else None)


def _checked_start(state, global_batch: int) -> int:
    """The checkpoint's start_position (0 where none), checked against its step and
    position: a resumed stream is shifted by its start's distance from a step's start, and
    the checkpoint stands at a step of that stream at or after it."""
    start = state.get("start_position", 0)
    step, position = state.get("step"), state.get("position")
    if start and (not _is_int(step) or not _is_int(position) or start > position or
                  position - step * global_batch != start % global_batch):
        raise ValueError(f"the checkpoint's start_position {start} disagrees with its step {step!r} and position "
                         f"{position!r} (a stream resumed there holds position {start % global_batch} + "
                         f"step * {global_batch} at each step, from that one on); pass the state_dict() as it was")
    return start


# Settings added after checkpoints were first written, and the value a checkpoint without
# the key was made under (the behaviour before the setting existed). A missing key is that
# value, never "whatever this loader has": a checkpoint from before shuffle_window existed
# names steps of the global shuffle, and a windowed loader must refuse it.
_VALUE_BEFORE_KEY = {"shuffle_window": None, "block_rows": 1, "epochs": None, "drop_last": None}
_MISSING = "(not recorded)"


def _recorded(state, key: str):
    """The value `state` records for a setting, or what its absence means."""
    if key in state:
        return state[key]
    return _VALUE_BEFORE_KEY.get(key, _MISSING)


def _sources_change(saved: list[dict], mine: list[dict]) -> str:
    if len(saved) != len(mine):
        return f"{len(saved)} sources in the checkpoint, {len(mine)} in this loader"
    changes = []
    for index, (before, after) in enumerate(zip(saved, mine)):
        for key in after:
            if before.get(key) != after[key]:
                what = "its file list" if key == "files_digest" else key
                changes.append(f"source {index} {what}: {before.get(key)!r} in the checkpoint, {after[key]!r} now")
    return "; ".join(changes)
