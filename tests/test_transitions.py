"""The slot protocol's transition table (ring/transitions.py) is the code's: every write of a
slot's state word in C, Python and Zig is found here, each is a change the table lists, made
in the function the table names, and each change the table lists is made somewhere; the
Python side asserts each transition's precondition where it makes it."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import struct

import pytest

from shmloader.readers.filling import fill_and_publish
from shmloader.ring.layout import SLOT_CONTROL_BYTES, RingLayout, SlotState
from shmloader.ring.publishing import Publisher
from shmloader.ring.segment import Ring
from shmloader.ring.slot_layout import Region, SlotLayout
from shmloader.ring.transitions import EDGES, TRANSITIONS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shmloader"
ZIG = ROOT / "zig"
STATES = {state.name for state in SlotState}

# "transition: HELD -> IDLE" or "transition: FILLING -> READY, FILLING -> FAILED", or
# "transition: none (why)" for a store through a state primitive that is no slot's state.
TAG = re.compile(r"transition:\s*(none\b|[A-Z]+\s*->\s*[A-Z]+(?:\s*,\s*[A-Z]+\s*->\s*[A-Z]+)*)")
TAG_LINES_ABOVE = 3

# The Zig exports that store whatever state word their caller gives: their callers (Python)
# say which transition each call makes.
ZIG_GENERIC = {"shm_state_store", "shm_state_compare_swap", "shm_publish"}
# The C function that stores REQUESTED for its callers, who say which transition they make.
C_REQUEST = "request_slot"


class Site:
    """One write of a slot's state word: where, and the changes its tag (or code) names."""

    def __init__(self, path: pathlib.Path, line: int, function: str, edges, code: str) -> None:
        self.path, self.line, self.function, self.edges, self.code = path, line, function, edges, code

    @property
    def where(self) -> str:
        relative = self.path.relative_to(ZIG.parent if self.path.suffix == ".zig" else PACKAGE)
        return f"{relative}: {self.function}"

    def __repr__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.function})"


def tag_of(lines: list[str], index: int, site: str):
    """The changes the tag on line `index` or just above it names: a set of (from, to)
    names, or None for "none"."""
    for text in reversed(lines[max(0, index - TAG_LINES_ABOVE):index + 1]):
        found = TAG.search(text)
        if found:
            if found.group(1) == "none":
                return None
            edges = {tuple(part.strip() for part in edge.split("->")) for edge in found.group(1).split(",")}
            unknown = {state for edge in edges for state in edge} - STATES
            assert not unknown, f"{site}: its tag names no state of ring.h: {unknown}"
            return edges
    raise AssertionError(f"{site} writes a slot's state without a 'transition: FROM -> TO' comment on it or "
                         f"in the {TAG_LINES_ABOVE} lines above (see ring/transitions.py)")


# ---- C ----------------------------------------------------------------------------------

C_WRITE = re.compile(r"__atomic_(?!load)\w+\s*\(\s*&[^,]*\bstate\b|(?:->|\.)state\s*=[^=]|\b" + C_REQUEST + r"\s*\(")
C_FUNCTION = re.compile(r"^(?!typedef|static\s+\w+\s+\w+\[\])[A-Za-z][\w\s\*]*?\b(\w+)\s*\([^;]*$")


def c_sites() -> list[Site]:
    sites = []
    for path in sorted([*PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]):
        lines = path.read_text().splitlines()
        function, start = None, 0
        for index, text in enumerate(lines):
            head = C_FUNCTION.match(text)
            if head:
                function, start = head.group(1), index
            if not C_WRITE.search(text) or text.lstrip().startswith(("/*", "*")):
                continue
            site = f"{path.relative_to(ROOT)}:{index + 1}"
            if index == start and function == C_REQUEST:
                continue  # Its definition's line.
            body = "\n".join(lines[start:index + 1])
            if function == C_REQUEST:
                # The primitive itself: it stores REQUESTED, nothing else.
                assert "(uint64_t)SHM_SLOT_REQUESTED" in text, site
                continue
            edges = tag_of(lines, index, site)
            assert edges is not None, f"{site}: a C write of a state word is always a transition"
            for source, target in edges:
                stored = "REQUESTED" if re.search(r"\b" + C_REQUEST + r"\s*\(", text) else \
                    re.search(r"SHM_SLOT_(\w+)", text).group(1)
                assert target == stored, f"{site}: tagged '-> {target}' but stores {stored}"
                assert f"SHM_SLOT_{source}" in body, \
                    f"{site}: tagged '{source} ->' but {function} never looks at {source}"
            sites.append(Site(path, index + 1, function, edges, text))
    return sites


# ---- Python -----------------------------------------------------------------------------


def python_sites() -> list[Site]:
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("_ffi.py", "_declarations.py"):  # Generated; declarations as text.
            continue
        source = path.read_text()
        lines = source.splitlines()
        for function, node, body in _python_writes(ast.parse(source)):
            site = f"{path.relative_to(ROOT)}:{node.lineno}"
            edges = tag_of(lines, node.lineno - 1, site)
            if edges is None:
                continue
            for source_state, target in edges:
                for state in (source_state, target):
                    assert f"SlotState.{state}" in body, f"{site}: tagged with {state}, which {function} never names"
            sites.append(Site(path, node.lineno, function, edges, lines[node.lineno - 1]))
    return sites


def _python_writes(tree):
    """(qualified function name, node, the function's source) of each call of a Zig state
    primitive, and of each assignment to an attribute named `state` through a cffi struct."""
    found = []

    def visit(node, names, body):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*names, child.name], ast.unparse(child))
                continue
            call = isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
            if call and child.func.attr in ZIG_GENERIC:
                found.append((".".join(names), child, body))
            targets = child.targets if isinstance(child, ast.Assign) else []
            if any(isinstance(target, ast.Attribute) and target.attr == "state"
                   and isinstance(target.value, ast.Subscript) for target in targets):
                found.append((".".join(names), child, body))
            visit(child, names, body)

    visit(tree, [], "")
    return found


# ---- Zig --------------------------------------------------------------------------------

ZIG_WRITE = re.compile(r"@(atomicStore|cmpxchgStrong|cmpxchgWeak|atomicRmw)\s*\(")
ZIG_SWAP = re.compile(r"@cmpxchg(?:Strong|Weak)\s*\(\s*u64\s*,\s*&[^,]*\.state\s*,\s*(\w+)\s*,\s*(\w+)\s*,")
ZIG_STATE_CONSTANT = re.compile(r"const\s+(\w+)\s*:\s*u64\s*=\s*ring\.SHM_SLOT_(\w+)\b")
# The record of checked blocks lies in the ring too (storage/checked_blocks.py), but its bits
# are no slot's state: a reader setting one (block_digests.zig, Checker) makes no transition.
ZIG_CHECKED_BIT = re.compile(r"@atomicStore\s*\(\s*u64\s*,\s*&self\.checked\[")


def _zig_without_tests(text: str) -> str:
    """The file with its `test "..." { ... }` blocks blanked out (their lines kept)."""
    out, index = [], 0
    for block in re.finditer(r'^test\b[^{]*\{', text, re.M):
        if block.start() < index:
            continue
        depth, end = 0, block.end() - 1
        while True:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
            if depth == 0:
                break
        out.append(text[index:block.start()])
        out.append("\n" * text.count("\n", block.start(), end))
        index = end
    out.append(text[index:])
    return "".join(out)


def zig_sites() -> tuple[list[Site], set[str]]:
    """The sites, and the generic primitives the code defines."""
    sites, generic = [], set()
    for path in sorted(ZIG.glob("*.zig")):
        if path.name == "ring_h.zig":  # Generated from ring.h.
            continue
        lines = _zig_without_tests(path.read_text()).splitlines()
        # The file's own globals (a process's cached CPU feature, say) live in its memory,
        # never in the ring's shared pages: atomic writes to them are no slot transitions.
        own = {match.group(1) for match in re.finditer(r"^(?:pub\s+)?var\s+(\w+)", "\n".join(lines), re.M)}
        function, start = None, 0
        for index, text in enumerate(lines):
            head = re.match(r"^(?:pub\s+)?(?:export\s+)?(?:inline\s+)?fn\s+(\w+)", text)
            if head:
                function, start = head.group(1), index
            if not ZIG_WRITE.search(text):
                continue
            target = re.search(r"@\w+\s*\(\s*\w+\s*,\s*&(\w+)\s*,", text)
            if target and target.group(1) in own or ZIG_CHECKED_BIT.search(text):
                continue
            site = f"{path.relative_to(ROOT)}:{index + 1}"
            if function in ZIG_GENERIC:
                generic.add(function)
                continue
            swap = ZIG_SWAP.search(text)
            assert swap, (f"{site}: an atomic write in {function} that this test cannot read as a transition; "
                          f"make it a compare-and-swap of `.state` between named SHM_SLOT constants, or teach "
                          f"the test (and ring/transitions.py) the new write")
            constants = dict(ZIG_STATE_CONSTANT.findall("\n".join(lines[start:index + 1])))
            edge = (constants.get(swap.group(1)), constants.get(swap.group(2)))
            assert None not in edge, f"{site}: {swap.group(0)} between values that are no SHM_SLOT constant"
            sites.append(Site(path, index + 1, function, {edge}, text))
    return sites, generic


# ---- The tests --------------------------------------------------------------------------


def performed() -> set[tuple[str, str, str]]:
    """(from, to, where) of every state change the code makes."""
    zig, _ = zig_sites()
    return {(source, target, site.where) for site in [*c_sites(), *python_sites(), *zig]
            for source, target in site.edges}


def test_the_code_makes_exactly_the_changes_the_table_lists_each_where_the_table_says():
    tabled = {(t.source.name, t.target.name, t.where) for t in TRANSITIONS}
    found = performed()
    assert not found - tabled, f"changes the code makes that ring/transitions.py does not list: {found - tabled}"
    assert not tabled - found, f"changes ring/transitions.py lists that no code makes: {tabled - found}"


def test_the_zig_primitives_whose_callers_are_checked_are_the_ones_the_library_defines():
    """Renamed or new primitives would leave their callers unscanned."""
    _, generic = zig_sites()
    assert generic == ZIG_GENERIC


def test_held_to_idle_is_a_transition():
    """Before: the table left out the release pass's HELD -> IDLE at the end of a finite pass."""
    assert (SlotState.HELD, SlotState.IDLE) in EDGES


def test_the_table_is_a_state_machine_from_idle_in_which_failed_is_final_within_a_pass():
    assert all(t.source != t.target for t in TRANSITIONS)
    # Only the trainer leaves FAILED, and only for a new pass (Ring.renew_failed).
    assert [(t.target, t.who, t.where) for t in TRANSITIONS if t.source == SlotState.FAILED] == [
        (SlotState.IDLE, "trainer", "ring/segment.py: Ring.renew_failed")]
    reached, frontier = {SlotState.IDLE}, [SlotState.IDLE]
    while frontier:
        state = frontier.pop()
        for source, target in EDGES:
            if source == state and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(SlotState)
    assert {t.who for t in TRANSITIONS} == {"trainer", "reader r", "Ray bridge"}
    assert len({(t.source, t.target, t.where) for t in TRANSITIONS}) == len(TRANSITIONS)


def test_an_untagged_write_is_found():
    """The scanners' own check: a new store of a state without its tag fails the scan."""
    c_file = PACKAGE / "ring" / "_cursor.c"
    text = c_file.read_text().replace("/* transition: HELD -> IDLE */", "/* (untagged) */")
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if "(uint64_t)SHM_SLOT_IDLE" in line)
    with pytest.raises(AssertionError, match="without a 'transition: FROM -> TO' comment"):
        tag_of(lines, index, "_cursor.c")


# ---- The Python side's assertions -------------------------------------------------------


@pytest.fixture
def ring():
    slot = SlotLayout.of(4, (Region("x", (4,), "<u4"),), mixture=False)
    layout = RingLayout(slot_count=3, reader_count=2, batch_size=4, slot_bytes=slot.nbytes, field_count=1)
    created = Ring.create(layout, os.getpid())
    yield created
    created.names.unlink_all()
    created.close()


def request(ring, slot, step):
    """The trainer's request (ring/_cursor.h request_slot): the step word, then the state."""
    line = ring.layout.table_offset + slot * SLOT_CONTROL_BYTES
    struct.pack_into("<Q", ring.memory, line + 8, step)
    struct.pack_into("<Q", ring.memory, line, SlotState.REQUESTED)


def test_publishing_a_slot_the_reader_did_not_claim_is_an_assertion(ring):
    with pytest.raises(AssertionError):
        ring.publish(0, SlotState.READY, owner=0)  # IDLE: never claimed.
    request(ring, 1, 4)
    assert ring.claim(reader=1) == 1
    with pytest.raises(AssertionError):
        ring.publish(1, SlotState.READY, owner=0)  # FILLING by reader 1, not 0.
    with pytest.raises(AssertionError):
        ring.publish(1, SlotState.HELD, owner=1)  # FILLING -> HELD is no transition.
    ring.publish(1, SlotState.READY, owner=1)
    with pytest.raises(AssertionError):
        ring.publish(1, SlotState.READY, owner=1)  # Published once.
    assert ring.state(1) == (SlotState.READY, 1)


def test_fail_writes_the_report_then_publishes_failed_for_each_slot_the_reader_filled(ring):
    request(ring, 2, 5)
    assert ring.claim(reader=0) == 2
    publisher = Publisher(ring, 0, 1234)
    publisher.fail(b'{"type": "ValueError"}', (2,))
    assert ring.state(2) == (SlotState.FAILED, 0)
    assert ring.records.error(0) == b'{"type": "ValueError"}'
    assert ring.records.stats(0)[0] == 1234
    Publisher(ring, 1, 99).fail(b"{}")  # Failed before it claimed a slot: the report alone.
    assert ring.records.error(1) == b"{}"
    assert ring.state(0)[0] == ring.state(1)[0] == SlotState.IDLE
    with pytest.raises(AssertionError):
        Publisher(ring, 1, 99).fail(b"{}", (0,))  # Slot 0 is IDLE: reader 1 never claimed it.
    with pytest.raises(AssertionError, match="with its report"):
        Publisher(ring, 1, 99).fail(b"", ())


def test_a_filler_publishes_a_step_only_into_the_slot_that_holds_its_steps(ring):
    class Filler:
        skipped = []

        def fill(self, step, outputs):
            pass

    request(ring, 1, 7)
    assert ring.claim(reader=0) == 1
    publisher = Publisher(ring, 0, os.getpid())
    with pytest.raises(AssertionError):
        fill_and_publish(publisher, Filler(), 5, None, 2)  # Step 5 lives in slot 2, not 1.
    assert ring.state(1) == (SlotState.FILLING, 0)
    fill_and_publish(publisher, Filler(), 7, None, 1)
    assert ring.state(1) == (SlotState.READY, 0) and ring.step(1) == 7


def test_give_back_and_withdraw_change_only_the_state_they_expect(ring):
    request(ring, 0, 3)
    assert not ring.give_back(0, owner=1)  # REQUESTED, not FILLING by 1: unchanged.
    assert ring.claim(reader=1) == 0
    assert not ring.withdraw(0)  # Claimed first: a seek waits for it.
    assert ring.give_back(0, owner=1) and ring.state(0) == (SlotState.REQUESTED, 0)
    assert ring.withdraw(0) and ring.state(0) == (SlotState.IDLE, 0)
    assert ring.claim(reader=0) is None
