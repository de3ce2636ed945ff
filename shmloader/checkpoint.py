"""Checkpoints: what state_dict() records and the checks load_state_dict() makes before it
continues (a checkpoint of other data, settings or transform is refused, saying what)."""

from __future__ import annotations

import collections.abc

# The block-local shuffle's order, recorded with a shuffle_window: "sliding" since the
# order that dealt whole windows one after another (checkpoints without this key) was
# replaced; such a checkpoint's steps name other rows.
SHUFFLE_ORDER = "sliding"


def state_of(next_step: int, sampler, sources: list[dict], transform, finite=None) -> dict:
    """The next step to deliver, the sampler's settings, the sources' description, and a
    finite pass's epochs and drop_last."""
    state = {"step": next_step, **sampler.to_dict(), "sources": sources}
    if finite is not None:
        state.update(finite.to_dict())
    if transform is not None:
        state["transform"] = {"name": transform.name, "args": transform.args}
    if sampler.shuffle_window is not None:
        state["shuffle_order"] = SHUFFLE_ORDER
    return state


def step_to_resume(state, sampler, sources: list[dict], transform, finite=None):
    """The step `state` continues from, once it is this loader's checkpoint."""
    if not isinstance(state, collections.abc.Mapping):
        raise TypeError(f"state must be the mapping state_dict() returned, got {type(state).__name__}")
    # Settings added after a checkpoint format was first written are optional at their defaults.
    missing = sorted({"step", "sources", *sampler.to_dict()} - {"shuffle_window", "block_rows"} - set(state))
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
            state.get("shuffle_order") != SHUFFLE_ORDER:
        raise ValueError(f"the checkpoint was made with shuffle_window={state['shuffle_window']!r} by a shmloader "
                         f"whose block-local shuffle dealt whole windows one after another (no shuffle_order "
                         f"{SHUFFLE_ORDER!r} recorded); this one's order differs, so its steps name other rows. "
                         f"Resume it with the shmloader that wrote it, or seek(step) to continue in this order")
    expected = {**sampler.to_dict(), **({"epochs": None, "drop_last": None} if finite is None else finite.to_dict())}
    mismatched = {key: (_recorded(state, key), value) for key, value in expected.items()
                  if _recorded(state, key) != value}
    if mismatched:
        details = ", ".join(f"{key}: checkpoint {saved!r}, loader {mine!r}" for key, (saved, mine) in mismatched.items())
        raise ValueError(f"the checkpoint was made with other settings ({details}); its batches would differ")
    return state.get("step")


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
