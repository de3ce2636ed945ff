"""The configuration pipe into a reader (shmloader/readers/channel.py): messages are whole
lines, the newest wins, a line longer than the pipe's buffer arrives whole while the writer
is still writing, STOP and EOF are told apart, and a line cut by a dying writer is no
message."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmloader.readers.channel import STOP_MESSAGE, ConfigChannel, send_line, send_to_all


@pytest.fixture
def pipe():
    read_end, write_end = os.pipe()
    writer = os.fdopen(write_end, "wb")
    yield ConfigChannel(read_end), writer
    os.close(read_end)
    if not writer.closed:
        writer.close()


def test_the_first_message_then_nothing_until_another_comes(pipe):
    channel, writer = pipe
    send_line(writer, '{"a": 1}')
    assert channel.first() == b'{"a": 1}'
    assert channel.latest() is None
    send_line(writer, '{"a": 2}')
    send_line(writer, '{"a": 3}')
    assert channel.latest() == b'{"a": 3}'  # Two came since: the newest is what counts.
    assert channel.latest() is None


def test_messages_that_came_with_the_first_are_kept_for_latest(pipe):
    channel, writer = pipe
    send_line(writer, "first")
    send_line(writer, "second")
    assert channel.first() == b"first"
    assert channel.latest() == b"second"


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5 << 20))
def test_a_line_longer_than_the_pipe_holds_arrives_whole(size):
    read_end, write_end = os.pipe()
    channel, writer = ConfigChannel(read_end), os.fdopen(write_end, "wb")
    try:
        send_line(writer, "first")
        assert channel.first() == b"first"
        text = "x" * size
        thread = threading.Thread(target=send_line, args=(writer, text))  # Blocks until read.
        thread.start()
        found = None
        while found is None:
            found = channel.latest()
        thread.join()
        assert found == text.encode()
    finally:
        os.close(read_end)
        writer.close()


def test_stop_and_eof_are_told_apart(pipe):
    channel, writer = pipe
    writer.write(STOP_MESSAGE)
    writer.close()
    assert channel.first() == STOP_MESSAGE
    read_end, write_end = os.pipe()
    os.close(write_end)
    assert ConfigChannel(read_end).first() == b""
    os.close(read_end)


def test_a_line_cut_by_a_writer_that_died_is_no_message(pipe):
    channel, writer = pipe
    send_line(writer, "config")
    assert channel.first() == b"config"
    writer.write(b'{"half": ')
    writer.close()
    assert channel.latest() is None
    assert not channel.open and channel.latest() is None


def test_send_to_all_names_the_pipes_not_written_in_time_or_broken():
    pipes = [os.pipe() for _ in range(3)]
    writers = [os.fdopen(write_end, "wb") for _, write_end in pipes]
    os.close(pipes[2][0])  # Its reader is gone.
    text = "y" * (1 << 20)  # More than a pipe holds: written only as it is read.
    drained = []
    reader = threading.Thread(target=lambda: drained.append(ConfigChannel(pipes[0][0]).first()))
    reader.start()
    try:
        failed = send_to_all(writers, text, timeout_seconds=1.0)
        reader.join()
        assert failed == [1, 2] and drained == [text.encode()]
    finally:
        for (read_end, _), writer in zip(pipes, writers):
            writer.close()
            if read_end != pipes[2][0]:
                os.close(read_end)
