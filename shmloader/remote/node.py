"""The node cache as a whole (see cache.py for the design): its ledger (budget, bytes held,
counters, each process's reservations), eviction by last use, and one view per process
and root, shared by the loaders of the process.

Over the package's ~450 lines per module: the ledger's accounting (reserve, settle, reclaim,
recount, evict) is one set of invariants (_assert_ledger) that every change keeps; split
across files, each change would be argued against code elsewhere."""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import os
import queue
import stat
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np

from ..errors import StorageError
from . import deadline_left
from .pages import (
    CACHE_PAGE_BYTES,
    COUNTERS,
    DISK_SECTOR_BYTES,
    EVICT_SHARE,
    IN_FLIGHT,
    IN_FLIGHT_FIRST,
    MARKER_SUFFIX,
    OPEN_BASE,
    PAGES_SUFFIX,
    STAMP_BYTES,
    evict_page,
    lock,
    map_shared,
    now_stamp,
    open_private,
    page_disk_bytes,
    pages_file_bytes,
    private_directory,
    private_root,
    process_alive,
    punch_hole,
    reserve_file,
)

# "SHMCACI": a ledger whose evictions count themselves (NodeCache._evicting). "SHMCACH", the
# version before, evicts without counting: while its loaders use a cache, gathers pin.
_LEDGER_MAGIC, _LEDGER_MAGIC_UNCOUNTED = 0x53484D43414349, 0x53484D43414348
_LEDGER = {"magic": 0, "held": 1, "budget": 2, "requests": 3, "bytes": 4, "retries": 5, "evicted": 6,
           "evictions": 7}
_LEDGER_BYTES = 4096
# After the counters: (pid, bytes reserved in flight) per process using the cache.
_SLOTS_OFFSET, _SLOT_COUNT = 256, 240
# A bounded wait for the ledger's lock (NodeCache.locked) looks again after the first pause,
# then after pauses twice as long, up to the second.
_LEDGER_POLL_FIRST_SECONDS, _LEDGER_POLL_SECONDS = 0.0005, 0.02
_LEDGER_HOLDER = "held by another process of the node: one stopped (SIGSTOP, a job suspended) or hung in it"
# close() waits this long at most for the ledger's lock and the locks of its objects; past it
# the ledger and the objects' files stay open (their locks go when the process exits) and the
# reservations of this process's requests are given back by the next loader that needs room.
CLOSE_WAIT_SECONDS = 5.0


class RampingSlots:
    """A semaphore of `first` permits that gains one each time a request it let through
    ends, up to `most`: the read-ahead's requests in flight (IN_FLIGHT_FIRST). A permit
    given back unused (nothing to fetch) gains none."""

    def __init__(self, first: int, most: int) -> None:
        self._limit, self._most, self._taken, self._waiting = first, most, 0, 0
        self._condition = threading.Condition()

    def acquire(self) -> None:
        with self._condition:
            while self._taken >= self._limit or (self._waiting and self._limit < self._most):
                self._condition.wait()
            self._taken += 1

    @contextlib.contextmanager
    def fill_waiting(self):
        """While a fill of this process waits for pages it needs now, a read-ahead still
        ramping up makes no new request: the link is shared by the requests in flight, and
        one more for a later step would delay those the fill waits for (a first step waited
        for its two blocks and for the read-ahead's first requests beside them). Once
        ramped up, the read-ahead goes on: fills that wait then wait for the link, for
        blocks the read-ahead has asked for already, and pausing it left the link idle."""
        with self._condition:
            self._waiting += 1
        try:
            yield
        finally:
            with self._condition:
                self._waiting -= 1
                self._condition.notify_all()

    def release(self, used: bool = True) -> None:
        with self._condition:
            if self._taken <= 0:
                raise ValueError("RampingSlots released more often than acquired")
            self._taken -= 1
            if used:
                self._limit = min(self._most, self._limit + 1)
            self._condition.notify(2)


class FetchThreads:
    """The fetch threads of a kind (ThreadPoolExecutor's submit and shutdown), as daemon
    threads that nothing joins: a request the store never answers is given up on when its
    loader closes (shutdown), and the process exits without waiting for it, which
    concurrent.futures' threads, joined at exit, made it do for as long as the request hung."""

    def __init__(self, most: int, name: str) -> None:
        self._most, self._name = most, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, function, *arguments) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new fetches after the node cache closed")
            self._queue.put((future, function, arguments))
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._most:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            found = self._queue.get()
            if found is None:
                return
            future, function, arguments = found
            if future.set_running_or_notify_cancel():
                try:
                    result = function(*arguments)
                except BaseException as error:  # noqa: BLE001 - the future's to raise, as an executor's.
                    future.set_exception(error)
                else:
                    future.set_result(result)
                del future, function, arguments, found
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Cancels what waits for a thread and stops the threads once their request ends
        (`wait` is not honoured: nothing is waited for)."""
        with self._lock:
            self._shut = True
            while True:
                try:
                    found = self._queue.get_nowait()
                except queue.Empty:
                    break
                if found is not None and cancel_futures:
                    found[0].cancel()
            for _ in self._threads:
                self._queue.put(None)


class NodeCache:
    """One cache directory as this process sees it: the ledger, and the objects it opened."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        private_root(self.root)
        private_directory(os.path.join(self.root, "objects"), self.root)
        self._ledger_fd = open_private(os.path.join(self.root, "ledger"), os.O_RDWR | os.O_CREAT)
        try:
            # Zeros where new: a fresh ledger (held 0, no budget yet). Allocated before it is
            # mapped: a full file system is an error here, not a SIGBUS at the first write.
            reserve_file(self._ledger_fd, _LEDGER_BYTES, self.root, 0, "its ledger")
        except BaseException:
            os.close(self._ledger_fd)
            raise
        ledger_status = os.fstat(self._ledger_fd)
        self._ledger_identity = (ledger_status.st_dev, ledger_status.st_ino)
        self._ledger_map = map_shared(self._ledger_fd, _LEDGER_BYTES)
        self._ledger = np.frombuffer(self._ledger_map, dtype=np.int64, count=len(_LEDGER))
        self._slots = np.frombuffer(self._ledger_map, dtype=np.int64, count=2 * _SLOT_COUNT,
                                    offset=_SLOTS_OFFSET).reshape(_SLOT_COUNT, 2)
        # OFD locks do not exclude this process's own threads. Reentrant: settle() and close()
        # hold it around locked(), so that a settle never meets a ledger close() took down.
        self._thread_lock = threading.RLock()
        self._depth = 0  # Sections of locked() the thread holding _thread_lock is in.
        self._ledger_lock_named = f"the lock of the node cache's ledger ({self.root}/ledger), {_LEDGER_HOLDER}"
        self.creating: set[str] = set()  # Copies this process is making: not removed (_remove_unopened).
        # Reservations in flight that no slot of the ledger records (every slot held by a
        # live process): given back at close, or counted until the cache is next counted anew.
        self._untracked = 0
        with self.locked():
            magic = self._ledger[_LEDGER["magic"]]
            # A ledger an older version's loaders use now is left as it is (the same layout);
            # this view then reads pinned (eviction_sequence).
            if magic != _LEDGER_MAGIC and not (magic == _LEDGER_MAGIC_UNCOUNTED and not self._alone()):
                self._ledger[:] = 0
                self._slots[:] = 0
                self._ledger[_LEDGER["magic"]] = _LEDGER_MAGIC
        self._recount()
        lock(self._ledger_fd, fcntl.F_RDLCK, 1, 1, True)  # A user from now on (see _recount).
        self.objects: dict = {}  # path -> its cache.CachedObject, opened by cache.open_object
        # Openings of copies whose files were replaced since (cache.open_object): a loader may
        # read on through one, so they close with the view.
        self.superseded: list = []
        self.users = 0  # Loaders of this process holding this view (acquire/release).
        self.objects_lock = threading.Lock()
        self._pools: dict[str, FetchThreads] = {}
        self._pool_lock = threading.Lock()
        # The read-ahead's requests in flight, one per thread of its pool: a request is claimed
        # only when a thread is free for it, so a fill never waits on a claim that sits in the
        # pool's queue behind other objects' read-ahead (cache.CachedObject.prefetch).
        self.ahead_slots = RampingSlots(IN_FLIGHT_FIRST, IN_FLIGHT)

    # The ledger.

    @contextlib.contextmanager
    def locked(self, wait_seconds: float | None = None):
        """The ledger's lock, for this thread (reentrant: an OFD lock does not nest, so only
        the outermost section takes and drops it). Waited for without bound, but within the
        deadline of the step this thread fills (remote.step_deadline: StepTimeoutError) or
        for `wait_seconds` (TimeoutError): a process of the node stopped (SIGSTOP, a job
        suspended) or hung inside its section holds the lock for as long."""
        give_up = None if wait_seconds is None else time.monotonic() + wait_seconds
        self._wait_for(lambda wait: self._thread_lock.acquire(blocking=wait), give_up)
        try:
            self._depth += 1
            try:
                if self._depth == 1:
                    self._wait_for(lambda wait: lock(self._ledger_fd, fcntl.F_WRLCK, 0, 1, wait), give_up)
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    lock(self._ledger_fd, fcntl.F_UNLCK, 0, 1, False)
        finally:
            self._thread_lock.release()

    def _wait_for(self, take, give_up: float | None) -> None:
        """take(wait) (a lock; whether it was had), blocking where neither this thread's step
        deadline nor `give_up` (a time.monotonic()) bounds the wait, else polled until the
        first of them, each pause twice the one before: most holders hold the ledger for
        microseconds, and a pause of _LEDGER_POLL_SECONDS at once would be a step's delay."""
        what = self._ledger_lock_named
        if give_up is None and deadline_left(what) is None:
            take(True)
            return
        pause = _LEDGER_POLL_FIRST_SECONDS
        while not take(False):
            bounds = [pause, deadline_left(what) or pause]
            if give_up is not None:
                if time.monotonic() >= give_up:
                    raise TimeoutError(f"{what}, was not had within the time allowed")
                bounds.append(give_up - time.monotonic())
            time.sleep(max(0.0, min(bounds)))
            pause = min(2 * pause, _LEDGER_POLL_SECONDS)

    def count(self, requests: int = 0, size: int = 0, retries: int = 0, evicted: int = 0) -> None:
        with self.locked():
            for name, value in (("requests", requests), ("bytes", size), ("retries", retries), ("evicted", evicted)):
                if value:
                    self._ledger[_LEDGER[name]] += value

    def counters(self) -> dict:
        values = self._ledger.copy()
        return {"bytes_held": int(values[_LEDGER["held"]]), "bytes_budget": int(values[_LEDGER["budget"]]),
                **{name: int(values[_LEDGER[name]]) for name in COUNTERS}}

    def set_budget(self, budget: int) -> None:
        """Sets the node's budget as it is (tests; loaders join_budget)."""
        with self.locked():
            self._ledger[_LEDGER["budget"]] = budget

    def join_budget(self, budget: int) -> int:
        """A loader's budget joins the node's, which is the smallest budget of the loaders
        started since no loader used the cache (each loader's cache_bytes, or half the disk
        free where it gave none): a loader may lower it, never raise it, so that no loader
        overrides another's explicit bound. Returns the node's budget."""
        with self.locked():
            found = int(self._ledger[_LEDGER["budget"]])
            self._ledger[_LEDGER["budget"]] = budget if not found else min(found, budget)
            return int(self._ledger[_LEDGER["budget"]])

    def _recount(self) -> None:
        """The bytes held, counted anew where no other process uses the cache (each user
        holds the ledger's byte 1 shared): the pages present, and the cache's own files
        (ledger, pages files, markers), which the budget covers too. It forgets the
        reservations of processes killed mid-download, and gives back the space of the
        bytes they wrote that no stamp vouches for."""
        with self.locked():
            users = open_private(os.path.join(self.root, "ledger"), os.O_RDWR)
            try:
                if lock(users, fcntl.F_WRLCK, 1, 1, False):
                    if os.fstat(self._ledger_fd).st_size > _LEDGER_BYTES:
                        # Grown past its layout (damaged, or written by hand): the tail is no count's,
                        # and kept it would hold disk the budget cannot free.
                        os.ftruncate(self._ledger_fd, _LEDGER_BYTES)
                    held = os.fstat(self._ledger_fd).st_blocks * DISK_SECTOR_BYTES
                    for found in self._pages_files():
                        held += found.held + found.own_bytes
                        if found.data_disk_bytes > found.held:
                            _give_back_unstamped(found)
                    self._ledger[_LEDGER["held"]] = held
                    # No loader uses the cache: the next one's budget is the node's (set_budget).
                    self._ledger[_LEDGER["budget"]] = 0
                    # Every slot left is a dead process's (a user holds byte 1 from its start):
                    # the count above has no reservation in it, so none may be given back again.
                    self._slots[:] = 0
                    self._assert_ledger()
            finally:
                os.close(users)  # Closing the description drops its lock.

    def _pages_files(self):
        """Every object in the cache, as a CachedFiles."""
        for directory, _, names in os.walk(os.path.join(self.root, "objects")):
            for name in names:
                if name.endswith(PAGES_SUFFIX):
                    pages = os.path.join(directory, name)
                    try:
                        yield read_stamps(pages, pages[:-len(PAGES_SUFFIX)])
                    except (OSError, StorageError):  # Gone meanwhile, or not this user's: not counted.
                        continue

    def hold(self, size: int, replaced: int = 0) -> None:
        """Counts `size` bytes of the cache's own files (a new object's pages file and
        marker) as held for good, evicting pages first where they would pass the budget.
        `replaced`: what the ledger counted of the copy they replace (one made anew over
        damaged files: counted_bytes), given back first, never below the reservations in
        flight (files a killed process made were never counted: held may not have them)."""
        with self.locked():
            in_flight = int(self._slots[:, 1].sum()) + self._untracked
            self._ledger[_LEDGER["held"]] -= min(replaced, max(0, self._held() - in_flight))
            self._make_room(size)
            self._ledger[_LEDGER["held"]] += size
            self._assert_ledger()

    def reserve(self, size: int, optional: bool = False) -> bool:
        """Counts `size` bytes about to be downloaded, evicting first what would pass the
        budget; an `optional` reservation (the read-ahead's) that would still pass it is
        refused (False); it never evicts a page fetched ahead that no fill has read yet
        (stamped in the future: cache.AHEAD_STAMP_SECONDS), so that reading ahead past what
        the budget holds stops instead of evicting its own pages before they are read. Each
        process's reservations in flight are kept in its slot of the ledger, so that those
        of a process that died mid-download are given back."""
        with self.locked():
            if not self._make_room(size, now_stamp() if optional else None) and optional:
                return False
            self._ledger[_LEDGER["held"]] += size
            slot = self._slot()
            if slot is None:
                self._untracked += size
            else:
                slot[1] += size
            self._assert_ledger()
            return True

    def _make_room(self, size: int, newest: int | None = None) -> bool:
        """Evicts what `size` more bytes would pass the budget by (under the lock), pages
        stamped `newest` or before only where given; whether they fit now."""
        budget = int(self._ledger[_LEDGER["budget"]])
        if not budget or self._held() + size <= budget:
            return True
        self._reclaim_dead()
        held = self._held()
        if held + size > budget:
            wanted = held + size - budget + int(budget * EVICT_SHARE)
            with self._evicting():
                freed = self._evict(wanted, newest)
            self._ledger[_LEDGER["held"]] -= freed
            self._ledger[_LEDGER["evicted"]] += -(-freed // CACHE_PAGE_BYTES)
            if freed < wanted:  # The pages were not enough: the files of copies no loader has open go too.
                removed = min(self._held(), self._remove_unopened(wanted - freed))
                self._ledger[_LEDGER["held"]] -= removed
        self._assert_ledger()
        return self._held() + size <= budget

    @contextlib.contextmanager
    def _evicting(self):
        """An eviction (under the ledger lock, so one at a time on the node), counted in the
        ledger's sequence word: odd while it runs, two more once it is done. A gather that
        read its pages without pins (cache.CachedObject.pin, `unpinned`) compares the word
        before and after, and gathers again, pinned, where an eviction ran meanwhile. An
        odd word left by an evicting process that died is made even first: only gathers
        that read it while odd were unsure, and they pinned."""
        word = _LEDGER["evictions"]
        if self._ledger[word] % 2:
            self._ledger[word] += 1
        self._ledger[word] += 1
        try:
            yield
        finally:
            self._ledger[word] += 1

    def eviction_sequence(self) -> int | None:
        """The ledger's eviction sequence word (see _evicting), even: while an eviction runs
        it waits for it to end, and a word left odd by an evicting process that died is made
        even (else no gather would read unpinned until the next eviction, which a cache that
        holds the data never runs); None once the ledger is closed, or where it is not this
        version's (an older loader's evictions do not count themselves: gathers pin)."""
        ledger = self._ledger
        if ledger is None or ledger[_LEDGER["magic"]] != _LEDGER_MAGIC:
            return None
        word = int(ledger[_LEDGER["evictions"]])
        if word % 2:  # An eviction runs, or one died mid-way: under the lock, which every eviction holds...
            with self.locked():
                if self._ledger[_LEDGER["evictions"]] % 2:  # ...one still odd is a dead evictor's.
                    self._ledger[_LEDGER["evictions"]] += 1
                word = int(self._ledger[_LEDGER["evictions"]])
        return word

    def _alone(self) -> bool:
        """Whether no other view uses the cache now (each holds the ledger's byte 1 shared
        from its start; this one not yet, when called at its start)."""
        users = open_private(os.path.join(self.root, "ledger"), os.O_RDWR)
        try:
            return lock(users, fcntl.F_WRLCK, 1, 1, False)
        finally:
            os.close(users)  # Closing the description drops its lock.

    def _held(self) -> int:
        return int(self._ledger[_LEDGER["held"]])

    def _assert_ledger(self) -> None:
        """The ledger's invariants, after each change (under the lock): the bytes held are
        never negative, no process's reservations in flight are, and together they never
        pass the bytes held, which include them. Every process changes the ledger under its
        lock and keeps them, so one broken is a defect in this accounting: a reservation
        settled twice, bytes given back twice (a dead process's reservation both counted
        anew and reclaimed), a present page freed twice. Cheap: two numbers and a sum
        over the slots' table, once per reservation, never per page."""
        held = self._held()
        reserved = self._slots[:, 1]
        assert held >= 0, f"the node cache {self.root} holds {held} bytes"
        assert int(reserved.min()) >= 0, f"a reservation in the node cache {self.root} is {int(reserved.min())} bytes"
        assert int(reserved.sum()) + self._untracked <= held, \
            f"the node cache {self.root} has {int(reserved.sum()) + self._untracked} bytes in flight, {held} held"

    def has_room(self, size: int) -> bool:
        """Whether `size` more bytes fit the budget now, without an eviction: read without the
        ledger's lock, a hint (what a gather that reads unpinned asks before it fetches the
        pages it misses; an eviction it did not foresee makes it read again, pinned)."""
        ledger = self._ledger
        if ledger is None:
            return False
        budget = int(ledger[_LEDGER["budget"]])
        return not budget or int(ledger[_LEDGER["held"]]) + size <= budget

    def fits(self, size: int) -> bool:
        """Whether `size` more bytes fit the budget, evicting what they would pass it by (as
        an optional reservation does: never a page fetched ahead and not read yet): a fill
        asks before it fetches more than the pages it needs (cache.CachedObject._demand_pages)."""
        with self.locked():
            return self._make_room(size, now_stamp())

    def mark_absent(self, stamps: np.ndarray, page: int, size: int) -> None:
        """A page whose bytes failed their checksum: absent from here on, no longer held.
        Under the ledger lock, as evictions are: touch() never stamps it present again."""
        with self.locked(), self._evicting():  # Counted as an eviction: a gather unpinned meanwhile reads again.
            stamps[page] = 0
            self._ledger[_LEDGER["held"]] -= size
            self._assert_ledger()

    def touch(self, stamps: np.ndarray, pages: np.ndarray, stamp: int) -> None:
        """Stamps present `pages` used at `stamp` (the last to be evicted) without their
        USE locks (a gather that pinned nothing: cache.CachedObject.pin): under the ledger
        lock, which every change of a present page to absent holds (evictions, mark_absent),
        so that a page evicted meanwhile is never stamped present again over its hole."""
        with self.locked():
            pages = pages[stamps[pages] != 0]
            stamps[pages] = stamp

    def budget(self) -> int:
        return 0 if self._ledger is None else int(self._ledger[_LEDGER["budget"]])

    def settle(self, size: int, downloaded: bool) -> None:
        """A reservation's download ended, or its bytes are written and about to be stamped:
        they stay counted as held if it succeeded (nothing once this view is closed: close()
        gave its reservations back)."""
        with self._thread_lock:  # close() takes the ledger down under it.
            if self._ledger_fd is None:
                return
            with self.locked():
                untracked = min(size, self._untracked)
                self._untracked -= untracked
                given_back = 0
                if size > untracked:  # A reservation a slot records: it keeps its slot until close().
                    slot = self._own_slot()
                    mine = 0 if slot is None else min(size - untracked, int(slot[1]))
                    if slot is not None:
                        slot[1] -= mine
                    # The rest was given back already (no longer held): by another view of this
                    # ledger in this process that closed (the same directory by another path,
                    # or a close racing a new loader), or by a process in another PID
                    # namespace that took this pid for a dead one.
                    given_back = size - untracked - mine
                if downloaded:  # Its bytes are on disk: counted again where they had been given back.
                    self._ledger[_LEDGER["held"]] += given_back
                else:
                    self._ledger[_LEDGER["held"]] -= size - given_back
                self._assert_ledger()

    def _own_slot(self) -> np.ndarray | None:
        """This process's (pid, bytes reserved) in the ledger's table, or None (under the lock)."""
        own = np.flatnonzero(self._slots[:, 0] == os.getpid())
        return self._slots[own[0]] if len(own) else None

    def _slot(self) -> np.ndarray | None:
        """This process's slot, taken where it has none (under the lock); None where every
        slot belongs to a live process (its reservations then go untracked: a slot shared
        with another process would be given back by whichever of the two closes first)."""
        own = self._own_slot()
        if own is not None:
            return own
        free = np.flatnonzero(self._slots[:, 0] == 0)
        if not len(free):
            self._reclaim_dead()
            free = np.flatnonzero(self._slots[:, 0] == 0)
        if not len(free):
            return None
        slot = self._slots[free[0]]
        slot[:] = (os.getpid(), 0)
        return slot

    def _reclaim_dead(self) -> int:
        """Gives back the reservations of processes that are gone (under the lock): no longer
        held, their slots free. Returns the bytes given back."""
        alive = np.array([process_alive(int(pid)) for pid in self._slots[:, 0]], dtype=bool)
        dead = (self._slots[:, 0] != 0) & ~alive
        reclaimed = int(self._slots[dead, 1].sum())
        self._slots[dead] = 0
        self._ledger[_LEDGER["held"]] -= reclaimed
        return reclaimed

    def _evict(self, wanted: int, newest: int | None = None) -> int:
        """Frees at least `wanted` bytes if it can: present pages by last use, oldest first
        (and stamped `newest` or before, where given), skipping any page that is pinned or
        being fetched. Runs under the ledger lock.
        Stamps are read and written with pread/pwrite (the same page cache as every
        process's mapping of them)."""
        candidates = []  # (stamps, pages path, data path) of objects holding pages
        for found in self._pages_files():
            if found.held:
                candidates.append((found.stamps, found.pages, found.data))
        if not candidates:
            return 0
        stamps = np.concatenate([found for found, _, _ in candidates]).astype(np.int64)
        owners = np.repeat(np.arange(len(candidates)), [len(found) for found, _, _ in candidates])
        numbers = np.concatenate([np.arange(len(found)) for found, _, _ in candidates])
        present = np.flatnonzero(stamps if newest is None else (stamps != 0) & (stamps <= newest))
        order = present[np.argsort(stamps[present], kind="stable")]
        freed, descriptors = 0, {}
        try:
            for k in order.tolist():
                if freed >= wanted:
                    break
                owner, page = int(owners[k]), int(numbers[k])
                if owner not in descriptors:
                    _, pages, data = candidates[owner]
                    descriptors[owner] = _open_pair(pages, data)
                if descriptors[owner] is None:
                    continue
                pages_fd, data_fd, data_size = descriptors[owner]
                freed += evict_page(pages_fd, data_fd, data_size, page)
        finally:
            for found in descriptors.values():
                if found is not None:
                    os.close(found[0])
                    os.close(found[1])
        return freed

    def _remove_unopened(self, wanted: int) -> int:
        """Removes whole copies (data, pages file, marker, and their directories once empty)
        that no process has open, used longest ago first, until `wanted` bytes are freed:
        what the budget counts of them, their pages and own files (under the ledger lock).
        A process holds each copy it opened by its OPEN lock (cache.CachedObject); making
        one, it holds the ledger lock until it has it open (plan/localize.py)."""
        found = sorted((item for item in self._pages_files() if item.data not in self.creating),
                       key=lambda item: int(item.stamps.max(initial=0)))
        freed = 0
        for item in found:
            if freed >= wanted:
                break
            try:
                descriptor = open_private(item.pages, os.O_RDWR)
            except (OSError, StorageError):
                continue
            try:
                if not lock(descriptor, fcntl.F_WRLCK, OPEN_BASE, 1, False):
                    continue  # Open in a process: its files stay.
                for name in (item.data + MARKER_SUFFIX, item.data, item.pages):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)
                freed += item.held + item.own_bytes
            finally:
                os.close(descriptor)
            version = os.path.dirname(item.data)
            for directory in (version, os.path.dirname(version)):
                try:
                    os.rmdir(directory)
                except OSError:  # Not empty (a ragged directory's other members, other versions).
                    break
        return freed

    # Objects and fetching.

    def current(self) -> bool:
        """Whether this view is open and the ledger it opened is still the directory's (a
        closed view's ledger inode may have been reused since)."""
        if self._ledger_fd is None:
            return False
        try:
            status = os.lstat(os.path.join(self.root, "ledger"))
        except FileNotFoundError:
            return False
        return (status.st_dev, status.st_ino) == self._ledger_identity

    def close(self) -> None:
        """Closes every object, the fetch threads and the ledger (a loader's close, when no
        other loader of this process uses the directory)."""
        give_up = time.monotonic() + CLOSE_WAIT_SECONDS
        with self.objects_lock:
            for found in (*self.objects.values(), *self.superseded):
                found.close(max(0.0, give_up - time.monotonic()))
            self.objects.clear()
            self.superseded.clear()
        with self._pool_lock:
            for pool in self._pools.values():
                pool.shutdown(wait=False, cancel_futures=True)
            self._pools.clear()
        try:
            # A download settling meanwhile finds the ledger whole, or closed.
            self._wait_for(lambda wait: self._thread_lock.acquire(blocking=wait), give_up)
        except TimeoutError as error:
            warnings.warn(f"the node cache at {self.root} is left open at close ({error}): its files and locks go when "
                          f"this process exits", RuntimeWarning, stacklevel=2)
            return
        try:
            self._close_ledger(give_up)
        finally:
            self._thread_lock.release()

    def _close_ledger(self, give_up: float) -> None:
        """close()'s part under the thread lock: this process's reservations given back, the
        cache trimmed to its budget, the ledger closed; left open where its lock is not had
        by `give_up` (a stopped process holds it)."""
        if self._ledger_fd is None:
            return
        try:
            with self.locked(max(0.0, give_up - time.monotonic())):
                self._give_back_own()
        except TimeoutError as error:
            warnings.warn(f"the node cache at {self.root} is left open at close ({error}): its files and locks go when "
                          f"this process exits", RuntimeWarning, stacklevel=2)
            return
        self._ledger = self._slots = None
        with contextlib.suppress(BufferError):  # A view held elsewhere: unmapped with it.
            self._ledger_map.close()
        os.close(self._ledger_fd)  # Its locks (the users' byte) go with it.
        self._ledger_fd = None

    def _give_back_own(self) -> None:
        """Gives back this process's reservations (downloads given up on at close) and trims
        the cache to its budget (under the lock)."""
        slot = self._own_slot()
        if slot is not None:
            self._ledger[_LEDGER["held"]] -= slot[1]
            slot[:] = 0
        del slot  # A view of the mapping: it must go before the mapping can close.
        self._ledger[_LEDGER["held"]] -= self._untracked
        self._untracked = 0
        # Back within the budget: what the fills held pinned beyond it is free now
        # (pages pinned by loaders of other processes stay, and are theirs to give back).
        self._make_room(0)
        self._assert_ledger()

    def pool(self, kind: str = "demand") -> FetchThreads:
        """The fetch threads: "demand" for the pages a fill waits for, "ahead" for the
        read-ahead's (apart, so that a fill never queues behind the read-ahead's requests)."""
        with self._pool_lock:
            pool = self._pools.get(kind)
            if pool is None:
                pool = self._pools[kind] = FetchThreads(IN_FLIGHT, f"shmloader-fetch-{kind}")
            return pool


class CachedFiles(NamedTuple):
    """An object's files as its pages file says: what the budget counts of them."""

    pages: str
    data: str
    stamps: np.ndarray
    size: int  # The object's (its data file's) size.
    held: int  # The disk its present pages take.
    data_disk_bytes: int  # The disk its data file takes: more than `held` where unstamped bytes are left.
    own_bytes: int  # The disk its pages file and marker take.


def read_stamps(pages: str, data: str) -> CachedFiles:
    """An object's stamps and sizes (files of this user, links not followed). A pages file
    that is not of its data file's size (damaged, or cut short or grown between runs)
    vouches for no page, as create_object holds: its stamps are not read (none), so that
    one grown to any size costs no more than a stat, here and in every eviction's scan.
    One whose data file is gone (removed by hand, or a removal killed between its unlinks)
    is an orphan: no page, its own files counted, and removed as a copy nobody has open."""
    try:
        descriptor = open_private(data, os.O_RDONLY)
    except FileNotFoundError:
        size = data_disk_bytes = 0
    else:
        try:
            info = os.fstat(descriptor)
        finally:
            os.close(descriptor)
        size, data_disk_bytes = info.st_size, info.st_blocks * DISK_SECTOR_BYTES
    count = -(-size // CACHE_PAGE_BYTES)
    descriptor = open_private(pages, os.O_RDONLY)
    try:
        pages_info = os.fstat(descriptor)
        if pages_info.st_size != pages_file_bytes(count):
            count = 0
        stamps = np.frombuffer(os.pread(descriptor, STAMP_BYTES * count, 0), dtype=np.uint32).copy()
        own_bytes = pages_info.st_blocks * DISK_SECTOR_BYTES
    finally:
        os.close(descriptor)
    with contextlib.suppress(OSError):
        own_bytes += os.lstat(data + MARKER_SUFFIX).st_blocks * DISK_SECTOR_BYTES
    present = np.flatnonzero(stamps)
    held = len(present) * CACHE_PAGE_BYTES
    if len(present) and present[-1] == len(stamps) - 1:
        held -= CACHE_PAGE_BYTES - page_disk_bytes(len(stamps) - 1, size)  # The last page is shorter.
    return CachedFiles(pages, data, stamps, size, max(0, held), data_disk_bytes, own_bytes)


def counted_bytes(data: str) -> tuple[int, int]:
    """What the ledger counts of the copy whose data file is `data`, as _recount counts it:
    (its present pages, its own files); zeros where its files are not there."""
    try:
        found = read_stamps(data + PAGES_SUFFIX, data)
    except (OSError, StorageError):
        return 0, 0
    return found.held, found.own_bytes


def _give_back_unstamped(found: CachedFiles) -> None:
    """Frees the space of an object's absent pages (bytes a process killed mid-download
    wrote before it could stamp them); only while no other process uses the cache."""
    try:
        descriptor = open_private(found.data, os.O_RDWR)
    except (OSError, StorageError):
        return
    try:
        if not len(found.stamps):  # A pages file of another size (read_stamps): no page is vouched for.
            punch_hole(descriptor, 0, -(-found.size // CACHE_PAGE_BYTES) * CACHE_PAGE_BYTES)
            return
        absent = np.flatnonzero(found.stamps == 0)
        if not len(absent):
            return
        breaks = np.flatnonzero(np.diff(absent) != 1) + 1
        for run in np.split(absent, breaks):
            start = int(run[0]) * CACHE_PAGE_BYTES
            # To the end of the run's last page, past the file's end: a punch frees whole blocks only.
            punch_hole(descriptor, start, (int(run[-1]) + 1) * CACHE_PAGE_BYTES - start)
    except OSError:
        pass  # A file system without hole punching: the space stays, as before.
    finally:
        os.close(descriptor)


def _open_pair(pages: str, data: str) -> tuple[int, int, int] | None:
    """(pages descriptor, data descriptor, data size) for an eviction, or None where either
    is gone or not this user's."""
    try:
        pages_fd = open_private(pages, os.O_RDWR)
    except (OSError, StorageError):
        return None
    try:
        data_fd = open_private(data, os.O_RDWR)
    except (OSError, StorageError):
        os.close(pages_fd)
        return None
    return pages_fd, data_fd, os.fstat(data_fd).st_size


class CacheUse:
    """One loader's use of the node cache, for its stats(): the cache's budget and bytes held
    now, and its requests, bytes fetched, retries and pages evicted since the loader started
    (by every process of the node that uses the cache). Frozen when the loader closes, so
    that stats() after close still says what the run cost."""

    def __init__(self, cache: NodeCache) -> None:
        self.cache, self._started, self._final = cache, cache.counters(), None

    def stats(self) -> dict:
        if self._final is not None:
            return self._final
        now = self.cache.counters()
        return {**now, **{name: now[name] - self._started[name] for name in COUNTERS}}

    def freeze(self) -> None:
        if self._final is None:
            self._final = self.stats()


_caches: dict[tuple[int, str], NodeCache] = {}
_caches_lock = threading.Lock()


def _view(root: str) -> NodeCache:
    """node_cache() under _caches_lock, held by the caller. A view whose directory was
    removed (and made again) is replaced; closed now where no loader holds it, else by the
    release() of the last one (they read on from the files they have open)."""
    key = (os.getpid(), os.path.abspath(root))
    cache = _caches.get(key)
    if cache is not None and not cache.current():
        del _caches[key]
        if not cache.users:
            cache.close()
        cache = None
    if cache is None:
        cache = _caches[key] = NodeCache(root)
    return cache


def node_cache(root: str) -> NodeCache:
    """This process's view of the cache at `root` (one per process and directory; a new one
    where the directory was removed and made again)."""
    with _caches_lock:
        return _view(root)


def acquire(root: str) -> NodeCache:
    """node_cache() for a loader, which release()s it when it closes (one lock for both, so
    that a release between them cannot close the view being handed out)."""
    with _caches_lock:
        cache = _view(root)
        cache.users += 1
        return cache


def release(cache: NodeCache) -> None:
    """A loader is done with the view: the last one of this process closes it (its files,
    threads and locks). Counted per view, not per directory: a view replaced while loaders
    held it (_view) and the view that replaced it are each closed by their own last loader."""
    key = (os.getpid(), cache.root)
    with _caches_lock:
        assert cache.users > 0, (cache.root, cache.users)
        cache.users -= 1
        if cache.users:
            return
        if _caches.get(key) is cache:
            del _caches[key]
    cache.close()


# A stalled step blames the cache (stall_note) where it holds at least this share of its
# budget and has evicted: rows it lost are fetched again, a request per page.
_FULL_SHARE = 1 / 2
_MIB = 1 << 20


def stall_note() -> str:
    """Why a step may be slow when this process's node caches are the reason: a cache full
    and evicting, with the cache_bytes that would hold the data its loaders read (the
    objects this process opened, and the cache's own files); "" where no cache is full."""
    with _caches_lock:
        views = [cache for (pid, _), cache in _caches.items() if pid == os.getpid()]
    notes = []
    for cache in views:
        try:
            counters = cache.counters()
        except AttributeError:  # Closed by another thread meanwhile: its ledger is unmapped.
            continue
        budget, held = counters["bytes_budget"], counters["bytes_held"]
        if not budget or not counters["evicted"] or held < budget * _FULL_SHARE:
            continue
        with cache.objects_lock:
            data_bytes = sum(found.size for found in cache.objects.values())
        # The cache's own files: a pages file of 8 bytes per page, a marker, the ledger.
        fits = -(-int(data_bytes * (1 + 2 * STAMP_BYTES / CACHE_PAGE_BYTES)) // _MIB) * _MIB + _MIB
        fit = (f"cache_bytes={fits} ({fits / _MIB:.0f} MiB: the data read through it, {data_bytes / _MIB:.1f} "
               f"MiB, and the cache's own files) would keep every row after its first read; with shuffle_window, "
               f"the blocks of one window and the next are enough") if data_bytes > budget else \
            "more cache_bytes would keep more of the rows"
        notes.append(f"the node cache at {cache.root} is full (cache_bytes={budget}, {held / _MIB:.1f} MiB held) "
                     f"and has evicted {counters['evicted']} pages: rows it no longer holds are fetched from the "
                     f"store again, a request per page, at the store's request rate; {fit}")
    return "; ".join(notes)


# Of a process's open descriptors, the first this many are looked through for a ledger (a
# view opens its ledger first, before its objects' files).
_DESCRIPTORS_SCANNED_MAX = 1024


def evicted_bytes_of(pids) -> int | None:
    """The bytes evicted so far from the node caches that processes `pids` have open (each
    ledger counted once), or None where none of them has one open: what `shmloader top`
    knows of a loader's cache from outside it (tools/monitor.py). A ledger is found among
    /proc/PID/fd and opened by its path only where that is the very file the process holds
    (device and inode), a regular file with this version's magic: foreign input. It is read
    without its lock: a counter torn by a write meanwhile is off for one sample."""
    seen, evicted = set(), None
    for pid in pids:
        directory = f"/proc/{pid}/fd"
        try:
            names = os.listdir(directory)[:_DESCRIPTORS_SCANNED_MAX]
        except OSError:
            continue  # Gone, or not this user's to read.
        for name in names:
            try:
                target = os.readlink(f"{directory}/{name}")
                held = os.stat(f"{directory}/{name}")
            except OSError:
                continue
            if os.path.basename(target) != "ledger" or (held.st_dev, held.st_ino) in seen:
                continue
            pages = _ledger_evicted_pages(target, (held.st_dev, held.st_ino))
            if pages is not None:
                seen.add((held.st_dev, held.st_ino))
                evicted = (evicted or 0) + pages * CACHE_PAGE_BYTES
    return evicted


def _ledger_evicted_pages(path: str, identity: tuple[int, int]) -> int | None:
    """The evicted pages of the ledger at `path` where it is the file of `identity`, else None."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode) or (found.st_dev, found.st_ino) != identity:
            return None
        values = np.frombuffer(os.pread(descriptor, 8 * len(_LEDGER), 0), dtype=np.int64)
    except OSError:
        return None
    finally:
        os.close(descriptor)
    if len(values) < len(_LEDGER) or values[_LEDGER["magic"]] != _LEDGER_MAGIC or values[_LEDGER["evicted"]] < 0:
        return None
    return int(values[_LEDGER["evicted"]])


def cache_root(path: str) -> str:
    """The cache directory that holds the copy at `path` (ROOT/objects/URL KEY/VERSION/NAME):
    found from where the copy is, so a cache directory moved or renamed still works."""
    directory = os.path.dirname(os.path.abspath(path))
    while os.path.basename(directory) != "objects":
        parent = os.path.dirname(directory)
        if parent == directory:
            raise StorageError(f"{path}: not in a shmloader cache directory (no objects/ above it)")
        directory = parent
    return os.path.dirname(directory)
