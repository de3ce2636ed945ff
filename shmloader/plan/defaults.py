"""The ring's default size: how many readers and slots a loader gets when it is not told,
from the node's cores and trainers, the bounds readers="auto" and slots="auto" keep to, and
the node's reader budget (SHMLOADER_CPU_BUDGET)."""

from __future__ import annotations

import os

from ..ring import backing
from .cpu_quota import cpu_quota, quota_cores
from ..ring.layout import SHM_DIRECTORY

# ---- Sizing the ring ----------------------------------------------------------------------


# Environment variables that say how many trainer processes share this node, in order:
# torchrun's, then Slurm's (a launcher that sets neither can set LOCAL_WORLD_SIZE itself).
LOCAL_TRAINERS_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def local_trainers(environment=os.environ) -> int:
    """How many trainers share this node (1 when no launcher says)."""
    for variable in LOCAL_TRAINERS_VARIABLES:
        value = environment.get(variable, "")
        if not value.strip():
            continue
        text = value.split("(")[0].strip()  # Slurm may write "4(x2)".
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{variable}={value!r}: expected a positive integer (the trainers on this node, as a "
                             f"launcher sets it); fix or unset it, or give readers= explicitly")
        return int(text)
    return 1


def _affinity_cores() -> tuple[int, int]:
    """(the cores this process may use, the machine's cores): a CPU quota's whole cores bound
    both (a container or pod with a CPU limit: plan/cpu_quota.py), since its group gets that
    much CPU time whatever cores it may be scheduled on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    machine = max(cores, os.cpu_count() or cores)
    limit = quota_cores(cpu_quota())
    if limit is not None:
        cores, machine = min(cores, limit), min(machine, limit)
    return cores, machine


def usable_cores() -> int:
    """The cores this process may use: its affinity's, bounded by a CPU quota (cpu_quota.py)."""
    return _affinity_cores()[0]


def cores_share(environment=os.environ) -> int:
    """The cores this process may use, divided among the node's trainers (each one starts
    its own loader: eight ranks with a reader per core each would run 8x the cores), at
    least one."""
    cores, machine = _affinity_cores()
    # A rank pinned to its own cores (affinity already divided) keeps them all.
    return max(1, cores if cores < machine else cores // local_trainers(environment))


# ---- The node's reader budget (readers/node_budget.py) ----------------------------------

# Caps the reader processes of every loader on the node together.
CPU_BUDGET_VARIABLE = "SHMLOADER_CPU_BUDGET"
# The largest cap taken: the budget record counts readers in 32-bit fields, and no node
# runs more reader processes than this.
CPU_BUDGET_MAX = 65536


def cpu_budget_cap(environment=os.environ) -> int | None:
    """SHMLOADER_CPU_BUDGET as a number of readers, None where it is unset or empty."""
    value = environment.get(CPU_BUDGET_VARIABLE, "")
    if not value.strip():
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= CPU_BUDGET_MAX:
        raise ValueError(f"{CPU_BUDGET_VARIABLE}={value!r}: expected a whole number from 1 to {CPU_BUDGET_MAX}, the "
                         f"most reader processes the loaders of this node run together; unset it for the node's "
                         f"cores less one per trainer")
    return int(text)


def node_budget(environment=os.environ) -> int:
    """The readers every loader of the node may run together: SHMLOADER_CPU_BUDGET where set,
    else the node's cores less one for each trainer (LOCAL_WORLD_SIZE), and never fewer than
    the fixed default gives one trainer (default_readers): on a small node (2 cores: one
    trainer, two readers) a trainer that waits for data leaves its core to the readers, and
    auto, which grows only while the trainer waits and a core is idle, must be able to reach
    what a fixed loader runs there. A rank pinned to its own cores counts the node's as its
    own times the trainers."""
    cap = cpu_budget_cap(environment)
    if cap is not None:
        return cap
    cores, machine = _affinity_cores()
    trainers = local_trainers(environment)
    node_cores = cores if cores == machine else min(machine, cores * trainers)
    return max(1, node_cores - trainers, default_readers(environment))


def default_readers(environment=os.environ) -> int:
    """cores_share(), at most 8."""
    return min(cores_share(environment), 8)


# Slots a trainer's own references may hold at once: the batch in use, and the one a `for`
# loop's variable still holds while next() runs (ring/_cursor.c's readers_ahead counts them too).
TRAINER_SLOTS = 2
# The default ring stays under this many bytes where the readers' share allows (see default_slots).
_DEFAULT_RING_BYTES = 1 << 30


def default_slots(readers: int, slot_bytes: int, most: int | None = None,
                  ring_bytes: int = _DEFAULT_RING_BYTES) -> int:
    """Four slots per reader plus two for the trainer (the batch in use and the one a `for`
    loop's variable still holds while next() runs). A step filled slowly holds the
    trainer while the other readers run ahead: with two per reader they ran out of
    requested slots and slept, with four they stayed busy (bench/protocol.py --slots).
    Fewer where that passes _DEFAULT_RING_BYTES, but never under two per reader. With
    readers=0, one slot beyond the trainer's: the step it fills next. `most`: under
    readers="auto", `readers` is the count it starts and `most` the most it may reach (the
    node's budget and one: 9 for each of 8 ranks on 16 cores, where each starts 2): the ring
    is sized for the start, as a fixed loader's, with a slot for each reader it may add
    besides the trainer's and one (auto_slots' floor) where that stays under
    _DEFAULT_RING_BYTES; auto then adds no more readers than the slots feed (auto_readers_most).
    Sized for the most, 8 ranks' rings took 3.4x the memory of the fixed default's, and a
    64-core node's ring of 40 MiB batches 2.6 GiB, for readers that may never run.
    `ring_bytes`: the bound in place of _DEFAULT_RING_BYTES (default_ring_bytes: less in a
    container or pod whose memory is small)."""
    affordable = ring_bytes // max(1, slot_bytes)
    fixed = TRAINER_SLOTS + 1 if readers == 0 else \
        max(2 * readers + TRAINER_SLOTS, min(4 * readers + TRAINER_SLOTS, affordable))
    return fixed if most is None else max(fixed, min(most + TRAINER_SLOTS + 1, affordable))


def auto_readers_most(most: int, start: int, slots: int) -> int:
    """The most readers an auto loader's ring of `slots` feeds: one slot each besides the
    trainer's and one (a reader with no slot to fill only sleeps), never fewer than it starts."""
    return min(most, max(start, slots - TRAINER_SLOTS - 1))


# ---- slots="auto" ----------------------------------------------------------------------

# An automatic ring takes at most this share of the memory it may live in (the smaller of
# the memory this process may use and the room in /dev/shm or for anonymous memory), divided
# among the node's trainers: it is the fixed part of the loader's memory, next to the kept
# batches' quarter (KEPT_MEMORY_SHARE) and the read-ahead's share, and the model and the
# page cache need the rest.
AUTO_RING_MEMORY_SHARE = 1 / 8
# Slots per reader that keep every reader busy while one step is slow (default_slots' four).
AUTO_SLOTS_PER_READER = 4


def auto_slots(readers_max: int, slot_bytes: int, budget_bytes: int) -> int:
    """slots="auto": AUTO_SLOTS_PER_READER slots for each reader the loader may reach
    (readers_max: readers="auto" sizes the ring for its most) plus the trainer's
    TRAINER_SLOTS, the same rule as default_slots; fewer where that passes `budget_bytes`
    (ring_budget_bytes), but never fewer than one step per reader plus the trainer's slots
    and one more: below that a reader would have nothing to fill while the trainer holds
    its two. readers_max=0 (the trainer fills): one slot beyond the trainer's."""
    assert readers_max >= 0 and slot_bytes > 0 and budget_bytes >= 0
    if readers_max == 0:
        return TRAINER_SLOTS + 1
    floor = readers_max + TRAINER_SLOTS + 1
    wanted = AUTO_SLOTS_PER_READER * readers_max + TRAINER_SLOTS
    return max(floor, min(wanted, budget_bytes // slot_bytes))


def default_ring_bytes(environment=os.environ) -> int:
    """The default ring's bound (default_slots): _DEFAULT_RING_BYTES, or where the memory it
    may live in is small (a pod's memory limit, a container's /dev/shm and memory) the share
    an automatic ring takes (ring_budget_bytes): a ring's pages count against the memory
    group that touches them, and 1 GiB of a 2 GiB pod left the model too little."""
    return min(_DEFAULT_RING_BYTES, ring_budget_bytes(environment))


def ring_budget_bytes(environment=os.environ) -> int:
    """The bytes an automatic ring may take: AUTO_RING_MEMORY_SHARE of the smaller of the
    memory this process may use (memory_limit_bytes) and the room a ring has now (/dev/shm's
    free space, or where the ring may go to anonymous memory the memory still available),
    divided among the node's trainers."""
    rooms = []
    choice = backing.choice(environment)
    if choice != "anonymous":
        rooms.append(backing.free_bytes(SHM_DIRECTORY))
    if choice != "dev-shm":
        rooms.append(backing.memory_room_bytes())
    known = [room for room in rooms if room is not None]
    limit = memory_limit_bytes() if not known else min(memory_limit_bytes(), max(known))
    return int(limit * AUTO_RING_MEMORY_SHARE) // local_trainers(environment)


def wake_after(slots: int) -> int:
    """How many slots the trainer hands back before it wakes the readers while they are
    ahead (see cursor_release in ring/_cursor.c). Half the ring: they are woken at once whenever
    the batch after the one being delivered is not ready, so deferring costs no waiting."""
    return max(1, slots // 2)


# ---- Batches kept past their slot's turn -------------------------------------------------

# Batches the trainer keeps (kept.py: each given memory of its own when the ring needs its
# slot) take at most this share of the memory this process may use: past it the node would
# swap or its OOM killer would pick a process, so the error at the bound, which names what
# holds the memory, comes first. A quarter leaves the rest to the model, the page cache and
# the other trainers of the node (the read-ahead budget's share too: storage/readahead.py).
KEPT_MEMORY_SHARE = 1 / 4


def kept_bytes_max() -> int:
    """The bound on the memory of kept batches: KEPT_MEMORY_SHARE of the machine's memory, or
    of its memory cgroup's limit where that is lower."""
    return int(memory_limit_bytes() * KEPT_MEMORY_SHARE)


def memory_limit_bytes() -> int:
    """The memory this process may use for the page cache: the machine's, or its memory
    cgroup's limit (v1 or v2) where that is lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return limit
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates = [f"/sys/fs/cgroup{path}/memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
        else:
            continue
        for candidate in candidates:
            try:
                with open(candidate) as handle:
                    text = handle.read().strip()
            except OSError:
                continue
            if text.isdigit():
                limit = min(limit, int(text))
    return limit
