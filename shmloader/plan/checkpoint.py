"""Checkpoints: what state_dict() records and the checks load_state_dict() makes before it
continues (a checkpoint of other data, settings or transform is refused, saying what)."""

from __future__ import annotations

import collections.abc
import dataclasses

from .passes import FinitePass
from .reshard import Transition, transition_from
from .sampler import Sampler, global_position

# The block-local shuffle's order, recorded with a shuffle_window: "sliding" since the
# order that dealt whole windows one after another (checkpoints without this key) was
# replaced; such a checkpoint's steps name other rows.
SHUFFLE_ORDER = "sliding"
# Where a window covers the data (or a mixture's source), the global shuffle.
GLOBAL_ORDER = "global"


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
# The sampler's dealing of a resharded checkpoint: compared on its own (step_to_resume).
_NOT_COMPARED = ("transition",)


def position_of(sampler, next_step: int) -> tuple[int, str]:
    """(position, kind): where the stream stands before `next_step`, the same on every
    shard (each shard's next step is the same): the start of its global batch, or of the
    shard's own batch where each shard reads its own stream."""
    if getattr(sampler, "shard_blocks", False):
        return next_step * sampler.batch_size, SHARD
    return global_position(next_step, sampler.batch_size, 0, sampler.shard_count), GLOBAL


@dataclasses.dataclass(frozen=True)
class Resume:
    """A checkpoint continued under another batch size or shard count: the stream goes on
    from `position`; `step` is the new numbering's step holding it, of which the rows before
    `position` are cut (a first, shorter step)."""

    position: int
    kind: str
    step: int


def state_of(next_step: int, sampler, sources: list[dict], transform, finite=None, position: int | None = None) -> dict:
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
        state["shuffle_order"] = shuffle_order(sampler)
    return state


def shuffle_order(sampler) -> str:
    """The order a windowed sampler deals: "sliding" (the block-local shuffle), or where the
    window covers the data (a mixture's source) the global shuffle; a checkpoint records it,
    since a window that covers the data dealt blocks in a sliding order before."""
    window_blocks = getattr(sampler, "window_blocks", None)
    if window_blocks is None:  # One source.
        return SHUFFLE_ORDER if sampler.blocks_per_window else GLOBAL_ORDER
    covered = [index for index, blocks in enumerate(window_blocks) if not blocks]
    if not covered:
        return SHUFFLE_ORDER
    return f"{SHUFFLE_ORDER}, {GLOBAL_ORDER} for sources {covered}"


def step_to_resume(state, sampler, sources: list[dict], transform, finite=None):
    """The step `state` continues from, once it is this loader's checkpoint."""
    if not isinstance(state, collections.abc.Mapping):
        raise TypeError(f"state must be the mapping state_dict() returned, got {type(state).__name__}")
    # Settings added after a checkpoint format was first written are optional at their defaults.
    missing = sorted({"step", "sources", *sampler.to_dict()} - {"shuffle_window", "block_rows", *_NOT_COMPARED} -
                     set(state))
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
            state.get("shuffle_order") != shuffle_order(sampler):
        before = state.get("shuffle_order")
        what = ("whose block-local shuffle dealt whole windows one after another (no shuffle_order recorded)"
                if before is None else f"whose order was {before!r}")
        raise ValueError(f"the checkpoint was made with shuffle_window={state['shuffle_window']!r} by a shmloader "
                         f"{what}; this one's is {shuffle_order(sampler)!r} (a window that covers the data is the "
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
    dealt = None if state.get("transition") is None else Transition.from_dict(state["transition"])
    if "shard_count" in elastic and sampler.deals_on_reshard:
        return _resharded(state, sampler, dealt, finite)
    if not elastic - {"shard_index"}:  # The same global batches: the same step (shards may swap indices),
        step = state.get("step")       # or the rows from the position where a resumed first step is ahead.
        global_batch = sampler.batch_size * (1 if getattr(sampler, "shard_blocks", False) else sampler.shard_count)
        position = state.get("position")
        if isinstance(step, int) and isinstance(position, int) and 0 < position - step * global_batch < global_batch:
            return Resume(position, state.get("position_kind", GLOBAL), step), dealt
        return step, dealt
    return _elastic(state, sampler, elastic), dealt


def _checked_position(state, sampler) -> tuple[int, str]:
    """The checkpoint's position and its kind, checked against its step."""
    if "position" in state:
        position, kind = state["position"], state.get("position_kind", GLOBAL)
    else:  # Written before positions were recorded: the same arithmetic, from its own settings.
        step, batch, shards = state["step"], state["batch_size"], state["shard_count"]
        kind = SHARD if state.get("shuffle_window") is not None and shards > 1 and \
            getattr(sampler, "blocks_per_window", 0) else GLOBAL
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
        recorded = Sampler(sampler.length, old_batch, sampler.mode, sampler.seed, 0, old_count, sampler.shuffle_window,
                           sampler.block_rows, dealt)
        if state["step"] >= FinitePass.of(recorded, finite.epochs, finite.drop_last).steps:
            return PASS_ENDED, None
    if dealt is None:  # Every old shard stands at the same position of its own stream.
        positions = [position] * old_count
    elif position <= dealt.start:  # Its run had not begun its own dealing: deal the same rows anew.
        positions = list(dealt.positions)
    else:
        dealings = [sampler.of_shard(index, old_count).with_transition(dealt).dealing for index in range(old_count)]
        positions = [dealing.own_position(position) for dealing in dealings]
        if None in positions:
            end = max(dealing.piece_end_position for dealing in dealings)
            raise ValueError(
                f"the checkpoint was taken at position {position}, while its run (shard_count={old_count}) was still "
                f"dealing the rows an earlier shard count ({dealt.shard_count}) had left (until position {end}); a "
                f"dealing is not dealt again. Resume it with shard_count={old_count}, or change the shard count at a "
                f"checkpoint from step {-(-end // state['batch_size'])} on")
    step = position // sampler.batch_size
    epochs = None if finite is None else finite.epochs
    return step, transition_from(sampler, positions, step * sampler.batch_size, epochs)


def _elastic(state, sampler, changed: set) -> Resume:
    """Where a checkpoint taken under another batch size or shard count continues here."""
    position, kind = _checked_position(state, sampler)
    mine = SHARD if getattr(sampler, "shard_blocks", False) else GLOBAL
    if kind != mine:
        raise ValueError(f"the checkpoint's position counts {kind!r} stream positions and this loader's count "
                         f"{mine!r} ones, with the same settings otherwise; pass the state_dict() as it was")
    global_batch = sampler.batch_size * (1 if kind == SHARD else sampler.shard_count)
    return Resume(position, kind, position // global_batch)


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
