"""The API process's end of the engine's output socket (engine/core_client.py's OutputReceiver): a message is
taken whether it came before the wait or during it, bursts come out whole and in order, and an empty wait ends
at its timeout. Run on asyncio's own loop and on uvloop (which the server runs on where it is installed)."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from tokenmill.engine.core_client import OutputReceiver
from tokenmill.engine.messages import EngineCoreOutputs


def _loops():
    yield pytest.param(asyncio.new_event_loop, id="asyncio")
    try:
        import uvloop
    except ImportError:
        return
    yield pytest.param(uvloop.new_event_loop, id="uvloop")


def _message(i: int) -> list[bytes]:
    return [b"OUT", msgspec.msgpack.encode(EngineCoreOutputs(timestamp=float(i)))]


async def _exchange(addr: str) -> None:
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(addr)
    receiver = OutputReceiver(pull, msgspec.msgpack.Decoder(EngineCoreOutputs))
    try:
        # a message already there
        push.send_multipart(_message(1))
        got = await asyncio.wait_for(receiver.get(2000), 5)
        assert got is not None and got.timestamp == 1.0

        # nothing there: None once the timeout has passed, not before
        t = time.monotonic()
        assert await asyncio.wait_for(receiver.get(100), 5) is None
        assert time.monotonic() - t >= 0.09

        # a message that comes while the receiver waits wakes it well before its timeout
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, push.send_multipart, _message(2))
        t = time.monotonic()
        got = await asyncio.wait_for(receiver.get(10_000), 5)
        assert got is not None and got.timestamp == 2.0 and time.monotonic() - t < 2

        # a burst from another thread, sent while the receiver takes them: every one, in order, none lost
        def burst():
            sender = zmq.Context.instance().socket(zmq.PUSH)
            sender.connect(addr)
            for i in range(300):
                sender.send_multipart(_message(100 + i))
                if i % 50 == 0:
                    time.sleep(0.01)
            sender.close(linger=1000)

        thread = threading.Thread(target=burst)
        thread.start()
        seen = []
        while len(seen) < 300:
            got = await asyncio.wait_for(receiver.get(2000), 5)
            assert got is not None, f"a wait ended empty after {len(seen)} of the burst"
            seen.append(got.timestamp)
        thread.join()
        assert seen == [100.0 + i for i in range(300)]
    finally:
        receiver.close()
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("new_loop", list(_loops()))
def test_output_receiver_takes_every_message_and_times_out_when_none_come(tmp_path, new_loop):
    loop = new_loop()
    try:
        loop.run_until_complete(_exchange(f"ipc://{tmp_path}/out"))
    finally:
        loop.close()
