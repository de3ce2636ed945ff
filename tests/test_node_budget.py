"""One reader budget per node: the split's arithmetic against a modelled node (an add never
takes the node past its budget, a rank that waits gets readers from a rank whose readers
idle, no rank waits while another's readers idle once it settles), the record in /dev/shm
(a second loader sees the first's readers, a trainer killed with SIGKILL has its share
reclaimed, foreign and damaged records are refused without stopping the loader, nothing is
left once the last loader closes) and SHMLOADER_CPU_BUDGET's check."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import budget_entries, child_environment, examples, no_earned_readers, wait_until
from dataset_fixtures import Sleepy
from shmloader import NodeBudgetWarning, ShmDataLoader
from shmloader.errors import NodeBudgetError
from shmloader import session as session_module
from shmloader.plan import defaults
from shmloader.plan.options import AutoReaders
from shmloader.readers import autotune
from shmloader.readers import budget_record as record
from shmloader.readers.node_budget import Holding, equal_part, grant, room, yields

# Children run here, outside the checkout: its source would shadow an installed package (CI).
HERE = os.path.dirname(os.path.abspath(__file__))

# ---- The split, as pure functions ---------------------------------------------------------


@st.composite
def _nodes(draw):
    """A node within its budget: loaders fixed (readers=N) or changing, with what they ask."""
    budget = draw(st.integers(1, 24))
    holdings = []
    for _ in range(draw(st.integers(1, 6))):
        least = draw(st.integers(0 if not holdings else 1, 3))
        most = draw(st.integers(least, least + 8))
        held = draw(st.integers(least, most))
        fixed = draw(st.booleans())
        holdings.append(Holding(held, held, held) if fixed else
                        Holding(held, least, most, draw(st.integers(0, 8)), draw(st.integers(0, held - least))))
    return budget, holdings


@settings(max_examples=300, deadline=None)
@given(node=_nodes(), wanted=st.integers(0, 10), data=st.data())
def test_an_add_never_takes_the_node_past_its_budget_nor_a_loader_past_its_most(node, wanted, data):
    budget, holdings = node
    me = data.draw(st.integers(0, len(holdings) - 1))
    granted = grant(budget, holdings, me, wanted)
    assert 0 <= granted <= wanted
    assert holdings[me].held + granted <= holdings[me].most
    if room(budget, holdings) >= 0:
        assert sum(holding.held for holding in holdings) + granted <= budget
    else:  # Fixed loaders or explicit starts past the budget: no add until it is back within.
        assert granted == 0
    if holdings[me].fixed:
        assert granted == 0
    assert 0 <= yields(budget, holdings, me) <= holdings[me].held - holdings[me].least


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(2, 24), waiting_held=st.integers(1, 4), idle_least=st.integers(1, 3),
       idle_spare=st.integers(1, 8), asked=st.integers(1, 8))
def test_a_rank_that_waits_gets_readers_from_a_rank_whose_readers_idle(budget, waiting_held, idle_least,
                                                                       idle_spare, asked):
    idle_held = budget - waiting_held  # The budget is taken.
    if idle_held < idle_least + 1:
        return
    spare = min(idle_spare, idle_held - idle_least)
    waiting = Holding(waiting_held, 1, waiting_held + asked, wants=asked)
    idle = Holding(idle_held, idle_least, idle_held, spare=spare)
    assert grant(budget, [waiting, idle], 0, asked) == 0  # No room: it must come from the idle rank.
    given_up = yields(budget, [waiting, idle], 1)
    assert 1 <= given_up <= min(asked, spare)
    after = [waiting, Holding(idle_held - given_up, idle_least, idle_held)]
    assert grant(budget, after, 0, asked) == given_up
    assert yields(budget, [waiting, idle], 0) == 0  # The waiting rank gives nothing.


def _settle(budget: int, ranks: list[dict], rounds: int) -> list[Holding]:
    """Each round, each rank in turn publishes what its demand (readers its work would keep
    busy) asks or leaves spare, gives up what the split asks, and adds what it grants: the
    tuner's window, modelled. Checks the budget after every step."""
    holdings = [Holding(rank["start"], rank["least"], rank["most"]) for rank in ranks]
    for _ in range(rounds):
        for me, rank in enumerate(ranks):
            mine = holdings[me]
            target = min(rank["most"], max(rank["least"], rank["demand"]))
            holdings[me] = mine = Holding(mine.held, mine.least, mine.most, max(0, target - mine.held),
                                          max(0, mine.held - target))
            given_up = yields(budget, holdings, me)
            granted = 0 if given_up else grant(budget, holdings, me, mine.wants)
            held = mine.held - given_up + granted
            holdings[me] = Holding(held, mine.least, mine.most, mine.wants - granted, mine.spare)
            assert mine.least <= held <= mine.most
            assert sum(holding.held for holding in holdings) <= budget
    return holdings


@examples(200)
@given(budget=st.integers(1, 16), ranks=st.lists(st.fixed_dictionaries({
    "demand": st.integers(0, 16), "least": st.just(1), "most": st.integers(1, 16), "start": st.just(1)}),
    min_size=1, max_size=4))
def test_once_settled_no_rank_waits_while_another_ranks_readers_idle(budget, ranks):
    if len(ranks) > budget:
        return  # Each rank runs its least: more ranks than the budget start past it.
    for rank in ranks:
        rank["most"] = max(rank["most"], rank["least"])
    holdings = _settle(budget, ranks, rounds=4 * budget + 8)
    needs = [min(rank["most"], max(rank["least"], rank["demand"])) for rank in ranks]
    waiting = [index for index, holding in enumerate(holdings) if holding.held < needs[index]]
    idle = [index for index, holding in enumerate(holdings) if holding.held > needs[index]]
    assert not (waiting and idle), (holdings, needs)
    if waiting:  # The budget is the limit, taken in even parts where every rank wants more.
        assert sum(holding.held for holding in holdings) == budget, (holdings, needs)
        part = equal_part(budget, holdings)
        assert all(holdings[index].held >= min(needs[index], part) for index in waiting), (holdings, needs, part)
    alone = _settle(budget, ranks[:1], rounds=2 * budget + 4)
    assert alone[0].held == min(needs[0], max(budget, ranks[0]["least"]))  # Alone: what it can use.


@settings(max_examples=100, deadline=None)
@given(pids=st.lists(st.integers(1, 1 << 22), min_size=1, max_size=20, unique=True), data=st.data())
def test_the_entries_of_dead_trainers_are_freed_and_their_readers_come_back_to_the_node(pids, data):
    dead = set(data.draw(st.sets(st.sampled_from(pids))))
    entries = [record._Entry() for _ in range(record.ENTRY_COUNT)]
    for index, pid in enumerate(pids):
        entries[index * 3] = record._Entry(pid=pid, held=2, least=1, most=4, budget=64, token=index + 1)
    freed = record.reclaim(entries, alive=lambda entry: entry.pid not in dead)
    assert freed == len(dead)
    assert sorted(entry.pid for entry in entries if entry.pid) == sorted(set(pids) - dead)
    assert record.parse(record.pack(entries), "record") == entries  # What is written reads back.


# ---- The record in /dev/shm ------------------------------------------------------------------


_entries = budget_entries


def _record_gone() -> bool:
    return not os.path.exists(record.record_path())


def test_a_second_loader_sees_the_first_loaders_readers_and_the_last_to_close_removes_the_record(monkeypatch):
    no_earned_readers(monkeypatch)
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 0.2)
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "3")
    assert _record_gone()
    with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=1) as fixed:
        assert fixed.stats()["node_budget"]["node_readers"] == 1
        with ShmDataLoader.from_dataset(Sleepy(0.004), batch_size=4, readers=AutoReaders(start=1, most=3)) as auto:
            seen = auto.stats()["node_budget"]
            assert (seen["budget"], seen["node_readers"], seen["loaders"], seen["readers"]) == (3, 2, 2, 1)
            iterator = iter(auto)
            for _ in range(120):  # The auto loader's trainer waits: it asks for readers.
                next(iterator)
                held = sum(entry.held for entry in _entries())
                assert held <= 3 and fixed.stats()["reader_count"] + auto.stats()["reader_count"] <= 3, held
            assert auto.stats()["readers_most"] == 3  # Its ring is sized past the budget's room...
            assert auto.stats()["reader_count"] <= 2  # ...and it never runs past it.
        assert [entry.held for entry in _entries()] == [1]
    assert _record_gone()


def test_a_loader_whose_trainer_waits_gets_readers_from_one_whose_readers_idle(monkeypatch):
    no_earned_readers(monkeypatch)
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 0.2)
    monkeypatch.setattr(session_module, "_READER_CHECK_BATCHES", 8)
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "3")
    with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=AutoReaders(start=2, most=3)) as idle, \
            ShmDataLoader.from_dataset(Sleepy(0.004), batch_size=4, readers=AutoReaders(start=1, most=3)) as waits:
        idle_batches, waiting_batches = iter(idle), iter(waits)
        for _ in range(400):  # One training loop drives both: the first's readers run ahead and idle.
            next(waiting_batches)
            next(idle_batches)
            assert sum(entry.held for entry in _entries()) <= 3
            if waits.stats()["reader_count"] == 2:
                break
        given, taken = idle.stats()["reader_change"], waits.stats()["reader_change"]
        assert waits.stats()["reader_count"] == 2 and idle.stats()["reader_count"] == 1, (given, taken)
        assert "another loader of this node waits for readers" in given["why"], given
        assert (given["from"], given["to"], taken["from"], taken["to"]) == (2, 1, 1, 2)


def test_a_trainer_killed_with_sigkill_has_its_share_reclaimed_and_the_record_goes_with_the_last(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from shmloader.readers.budget_record import NodeShare
        share = NodeShare.join(held=5, least=5, most=5)
        print(share.report()["node_readers"], flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=HERE,
                             env={**child_environment(), defaults.CPU_BUDGET_VARIABLE: "8"})
    try:
        assert child.stdout.readline().strip() == "5"
        mine = record.NodeShare.join(held=1, least=1, most=4, environment={**os.environ,
                                                                             defaults.CPU_BUDGET_VARIABLE: "8"})
        assert (mine.last.node_held, mine.last.loaders) == (6, 2)
        assert mine.claim(1, 4) == 2  # The killed one's five leave room for two.
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: mine.publish(3).loaders == 1, timeout=10)  # A zombie runs nothing: freed.
        assert mine.last.node_held == 3
        assert mine.claim(3, 1) == 1
    finally:
        child.kill()
        child.wait()
    mine.close()
    mine.close()  # Idempotent.
    assert _record_gone()


@pytest.mark.parametrize("cleaner", ["the next loader", "a sweep"])
def test_a_record_left_by_a_killed_last_loader_is_removed(cleaner):
    child = subprocess.Popen([sys.executable, "-c", "from shmloader.readers.budget_record import NodeShare\n"
                              "NodeShare.join(held=2, least=2, most=2)\nimport os, signal\n"
                              "os.kill(os.getpid(), signal.SIGKILL)"], cwd=HERE, env=child_environment())
    assert child.wait() == -signal.SIGKILL
    assert not _entries() and not _record_gone()  # Left behind, its one entry dead.
    if cleaner == "a sweep":  # What a test run does at its end (conftest).
        live = record.NodeShare.join(held=1, least=1, most=1)
        assert not record.sweep(record.record_path())  # A live entry keeps it.
        live.close()
        assert record.sweep(record.record_path()) is False and _record_gone()  # Its close removed it.
        return
    with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=1) as loader:
        assert (loader.stats()["node_budget"]["node_readers"], loader.stats()["node_budget"]["loaders"]) == (1, 1)
    assert _record_gone()


def test_a_sweep_removes_a_record_of_dead_entries_only():
    entries = [record._Entry() for _ in range(record.ENTRY_COUNT)]
    entries[5] = record._Entry(pid=_dead_pid(), held=2, least=2, most=2, budget=4, token=1)
    with open(record.record_path(), "wb") as handle:
        handle.write(record.pack(entries))
    assert record.sweep(record.record_path()) and _record_gone()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("content", [b"not a record", b"\0" * record.RECORD_BYTES,
                                     record.pack([record._Entry()] * record.ENTRY_COUNT).replace(
                                         record.RECORD_MAGIC, b"SHMLBDGX")], ids=["short", "zeros", "magic"])
def test_a_foreign_or_damaged_record_is_refused_by_name_and_the_loader_runs_without_it(content):
    path = record.record_path()
    with open(path, "wb") as handle:
        handle.write(content)
    try:
        with pytest.warns(NodeBudgetWarning, match="without the node's reader budget") as caught:
            with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=1) as loader:
                assert next(iter(loader))["x"].shape == (4, 8)
                error = loader.stats()["node_budget"]["error"]
        assert path in error and "not a record this shmloader wrote" in error, error
        assert path in str(caught[0].message)
        with open(path, "rb") as handle:
            assert handle.read() == content  # Not this loader's to change or remove.
    finally:
        os.unlink(path)


def test_a_link_in_place_of_the_record_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    path = record.record_path()
    os.symlink(target, path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            share = record.NodeShare.join(held=1, least=1, most=1)
        assert share.error is not None and share.claim(1, 2) == 2  # Alone under no budget.
        assert any(issubclass(warning.category, NodeBudgetWarning) for warning in caught)
        share.close()
        assert target.read_bytes() == b""
    finally:
        os.unlink(path)


def test_a_record_made_anew_under_a_loader_gets_its_entry_again():
    share = record.NodeShare.join(held=2, least=1, most=4)
    os.unlink(record.record_path())  # As if the last other loader had judged this one gone.
    assert share.publish(2).node_held == 2
    assert [entry.held for entry in _entries()] == [2]
    share.close()
    assert _record_gone()


def test_a_loader_stopped_inside_the_records_lock_costs_another_one_wait_not_one_every_window(monkeypatch):
    monkeypatch.setattr(record, "_LOCK_WAIT_SECONDS", 0.05)
    share = record.NodeShare.join(held=1, least=1, most=4)
    holder = subprocess.Popen([sys.executable, "-c", "import os, signal\nfrom shmloader.readers import budget_record\n"
                               "fd = budget_record._open_locked(budget_record.record_path())\n"
                               "print('locked', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)"],
                              stdout=subprocess.PIPE, text=True, cwd=HERE, env=child_environment())
    timeouts = []
    locking = record._lock

    def counted(fd, path):
        try:
            locking(fd, path)
        except TimeoutError:
            timeouts.append(path)
            raise

    monkeypatch.setattr(record, "_lock", counted)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert wait_until(lambda: open(f"/proc/{holder.pid}/stat").read().split(") ")[1][0] == "T", timeout=10)
        for _ in range(10):  # Ten windows of a tuner whose update finds the lock taken.
            assert share.publish(1) is None and share.claim(1, 1) == 0
        assert len(timeouts) == 1 and share.error is None
    finally:
        holder.kill()
        holder.wait()
    share.retry_at = 0.0  # The back-off has passed: the next update waits again, and gets the lock.
    assert share.publish(2).node_held == 2 and len(timeouts) == 1
    share.close()
    assert _record_gone()


def test_a_fixed_loader_whose_join_found_the_lock_held_writes_its_entry_once_the_lock_is_free(monkeypatch):
    """A fixed loader writes its entry only at its join; one that met a loader stopped inside
    the record's lock would otherwise run uncounted, and the others take its cores."""
    monkeypatch.setattr(record, "_LOCK_WAIT_SECONDS", 0.05)
    monkeypatch.setattr(record, "_LOCK_BACKOFF_SECONDS", 0.1)
    monkeypatch.setattr(session_module, "_READER_CHECK_SECONDS", 0.05)
    holder = subprocess.Popen([sys.executable, "-c", "import os, signal\nfrom shmloader.readers import budget_record\n"
                               "fd = budget_record._open_locked(budget_record.record_path())\n"
                               "print('locked', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)"],
                              stdout=subprocess.PIPE, text=True, cwd=HERE, env=child_environment())
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert wait_until(lambda: open(f"/proc/{holder.pid}/stat").read().split(") ")[1][0] == "T", timeout=10)
        with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=2) as fixed:
            assert fixed._resources.node_share.last is None  # The join met the stopped holder.
            holder.kill()
            holder.wait()
            batches = iter(fixed)
            assert wait_until(lambda: next(batches) is not None and budget_entries() != [], timeout=20)
            assert [(entry.pid, entry.held, entry.least, entry.most) for entry in budget_entries()] == \
                [(os.getpid(), 2, 2, 2)]
        assert _record_gone()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("failing", ["the first write", "a later update"])
def test_a_loader_whose_record_update_failed_still_takes_its_entry_away_when_it_closes(failing, monkeypatch):
    other = None if failing == "the first write" else record.NodeShare.join(held=2, least=1, most=4)
    share = record.NodeShare.join(held=1, least=1, most=4) if other else None
    calls = {"pwrite": os.pwrite}

    def full(fd, data, offset):  # /dev/shm full (ENOSPC) or this process out of descriptors: once.
        monkeypatch.setattr(record.os, "pwrite", calls["pwrite"])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record.os, "pwrite", full)
    with pytest.warns(NodeBudgetWarning, match="No space left on device"):
        if share is None:
            share = record.NodeShare.join(held=1, least=1, most=4)
        else:
            assert share.publish(3) is None
    assert share.error is not None and share.claim(1, 2) == 2  # Alone under no budget, as documented.
    share.close()
    if other is None:
        assert _record_gone()  # Not an empty file in /dev/shm.
    else:
        assert [entry.held for entry in _entries()] == [2]  # Its readers went back to the node.
        other.close()
        assert _record_gone()


def test_a_record_whose_first_write_was_cut_short_by_a_kill_is_taken_with_its_missing_entries_free():
    entries = [record._Entry() for _ in range(record.ENTRY_COUNT)]
    entries[2] = record._Entry(pid=_dead_pid(), held=3, least=1, most=4, budget=8, token=1)
    whole = record.pack(entries)
    with open(record.record_path(), "wb") as handle:
        handle.write(whole[:8192])  # The kernel stops a write at a page for SIGKILL: torn at 8 KiB.
    share = record.NodeShare.join(held=1, least=1, most=4)
    assert share.error is None and (share.last.node_held, share.last.loaders) == (1, 1)
    assert os.path.getsize(record.record_path()) == record.RECORD_BYTES  # Whole again.
    share.close()
    assert _record_gone()
    for torn in (whole[:100], whole[:8192].replace(record.RECORD_MAGIC, b"SHMLBDGX")):  # Not a record's pages.
        with pytest.raises(NodeBudgetError, match="not a record this shmloader wrote"):
            record.parse(torn, "record")



@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a pid namespace")
def test_a_loader_whose_proc_shows_another_pid_namespace_runs_without_the_budget():
    # A sandbox that made its own pid namespace and kept the host's /proc: a pid there names
    # another process (pid 2 is the host's kthreadd), so a killed loader would look alive forever.
    code = ("import warnings\nfrom shmloader.readers.budget_record import NodeShare\n"
            "warnings.simplefilter('ignore')\nshare = NodeShare.join(held=2, least=1, most=4)\n"
            "print(share.error)\nshare.close()\n")
    result = subprocess.run(["unshare", "-p", "-f", sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=HERE, env=child_environment())
    if "unshare:" in result.stderr:
        pytest.skip(f"no pid namespace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert "/proc is another pid namespace's" in result.stdout, result.stdout
    assert _record_gone()


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "many", "٣", str(defaults.CPU_BUDGET_MAX + 1)])
def test_a_bad_cpu_budget_is_an_error_naming_the_variable_and_what_it_takes(value, monkeypatch):
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, value)
    with pytest.raises(ValueError, match=rf"SHMLOADER_CPU_BUDGET='{value}': expected a whole number from 1"):
        ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=1)
    with pytest.raises(ValueError, match="SHMLOADER_CPU_BUDGET"):
        AutoReaders().resolve()


def test_a_bad_budget_scope_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(record.SCOPE_VARIABLE, "../x")
    with pytest.raises(ValueError, match=r"SHMLOADER_BUDGET_SCOPE='\.\./x': expected 1-64 letters"):
        ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=1)


def test_the_budget_defaults_to_the_nodes_cores_less_its_trainers_and_auto_starts_within_it(monkeypatch):
    monkeypatch.delenv(defaults.CPU_BUDGET_VARIABLE, raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(defaults, "cpu_quota", lambda: None)  # The cores faked, not a CI host's CPU limit.
    for trainers, budget, start in ((1, 15, 8), (4, 12, 3), (8, 8, 1), (16, 1, 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(trainers))
        assert defaults.node_budget() == budget
        assert AutoReaders().resolve() == (start, 1, budget + 1)  # And one a trial may earn (readers/earned.py).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # Pinned: 4 cores of 4 ranks.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert defaults.node_budget() == 12
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "6")
    assert defaults.node_budget() == 6 and AutoReaders().resolve() == (1, 1, 6)
    assert AutoReaders(start=4, most=10).resolve() == (4, 1, 10)  # Explicit bounds are the user's.
    monkeypatch.delenv(defaults.CPU_BUDGET_VARIABLE)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # A small node: a waiting trainer's core
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # is the readers', as with the fixed default's two.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert defaults.node_budget() == defaults.default_readers() == 2


def test_a_fixed_loader_counts_against_the_budget_and_is_never_changed(monkeypatch):
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "2")
    with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=3) as loader:
        seen = loader.stats()["node_budget"]
        assert (seen["budget"], seen["node_readers"]) == (2, 3)  # Past the budget: counted, not cut.
        other = record.NodeShare.join(held=1, least=1, most=4)
        assert other.claim(1, 3) == 0
        other.close()
        assert next(iter(loader))["x"].shape == (4, 8)
        assert loader.stats()["reader_count"] == 3
