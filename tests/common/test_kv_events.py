"""KVEventBuffer: numbered events per epoch, cursors, a snapshot when a reader fell behind, and the
long poll of a reader that has every event."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.kv_events import KVEventBuffer
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import BlockRemoved, BlockStored

H = hash_blocks(HashNamespace("events-model", 2), list(range(2 * 64)))


def store(buffer: KVEventBuffer, *indices: int) -> None:
    for i in indices:
        buffer.append(BlockStored((H[i],), None, (0, 0)))


def seqs(batch) -> list[int]:
    return [seq for seq, _ in batch.events]


def test_events_are_numbered_and_read_after_a_cursor():
    buffer = KVEventBuffer("w", epoch=5)
    store(buffer, 0, 1, 2)
    buffer.append(BlockRemoved((H[1],)))
    batch = buffer.read_since(0)
    assert (batch.worker_id, batch.epoch, batch.last_seq, batch.snapshot) == ("w", 5, 4, None)
    assert seqs(batch) == [1, 2, 3, 4]
    assert batch.events[3][1] == BlockRemoved((H[1],))
    assert seqs(buffer.read_since(2)) == [3, 4]
    caught_up = buffer.read_since(4)
    assert (caught_up.events, caught_up.last_seq, caught_up.snapshot) == ((), 4, None)
    limited = buffer.read_since(1, max_events=2)
    assert (seqs(limited), limited.last_seq) == ([2, 3], 3)
    assert buffer.last_seq == 4


def test_a_reader_behind_the_capacity_gets_a_snapshot_of_what_is_cached_now():
    buffer = KVEventBuffer("w", capacity=3, epoch=5)
    store(buffer, 0, 1, 2, 3, 4)
    buffer.append(BlockRemoved((H[2],)))  # seq 6; the buffer holds seqs 4..6
    snap = buffer.read_since(0)
    assert (snap.events, snap.last_seq) == ((), 6)
    assert sorted(snap.snapshot) == sorted([H[0], H[1], H[3], H[4]])
    assert buffer.read_since(2).snapshot is not None  # needs seq 3, which is gone
    assert seqs(buffer.read_since(3)) == [4, 5, 6]  # needs seq 4 onwards: all still held


def test_a_negative_cursor_asks_for_a_snapshot():
    buffer = KVEventBuffer("w", epoch=5)
    assert buffer.read_since(-1).snapshot == ()  # an empty worker: an empty snapshot at seq 0
    store(buffer, 0, 1)
    snap = buffer.read_since(-1)
    assert (snap.snapshot, snap.last_seq) == ((H[0], H[1]), 2)


def test_a_cursor_of_another_epoch_gets_a_snapshot():
    buffer = KVEventBuffer("w", epoch=7)
    store(buffer, 0, 1, 2)
    assert buffer.read_since(10).snapshot == (H[0], H[1], H[2])  # beyond this epoch's last seq
    assert buffer.read_since(1, epoch=6).snapshot == (H[0], H[1], H[2])  # an old epoch's cursor
    assert seqs(buffer.read_since(1, epoch=7)) == [2, 3]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        KVEventBuffer("w", capacity=0)
    with pytest.raises(ValueError):
        KVEventBuffer("w").read_since(0, max_events=0)


def test_a_reader_following_a_concurrent_writer_ends_with_its_cache():
    buffer = KVEventBuffer("w", capacity=64, epoch=1)
    done = threading.Event()

    def write():
        for step in range(20_000):
            i = step % len(H)
            if (step // len(H)) % 2 == 0:
                store(buffer, i)
            else:
                buffer.append(BlockRemoved((H[i],)))
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    known, cursor = set(), 0
    while not done.is_set() or cursor < buffer.last_seq:
        batch = buffer.read_since(cursor, max_events=100)
        if batch.snapshot is not None:
            known = set(batch.snapshot)
        for _, event in batch.events:
            (known.update if isinstance(event, BlockStored) else known.difference_update)(event.block_hashes)
        cursor = batch.last_seq
    writer.join(10)
    assert known == set(buffer.read_since(-1).snapshot)


def test_a_long_poll_returns_at_once_with_events_to_read_and_is_woken_once_by_a_writer_thread():
    buffer = KVEventBuffer("w", epoch=5)
    store(buffer, 0)

    async def run() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        wakes = []
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            wakes.append(callback)
            return schedule(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign, assignment]  # counts the buffer's wakes
        await asyncio.wait_for(buffer.wait_past(0, 60.0), 5.0)  # behind: nothing to wait for
        behind = seqs(buffer.read_since(0))
        waiting = asyncio.ensure_future(buffer.wait_past(1, 60.0))
        await asyncio.sleep(0.05)  # the reader is waiting before the writer appends
        writer = threading.Thread(target=store, args=(buffer, 1, 2, 3))  # three events: one wake
        writer.start()
        writer.join(5.0)
        await asyncio.wait_for(waiting, 5.0)
        return behind, seqs(buffer.read_since(1)), len(wakes)

    behind, woken, wakes = asyncio.run(run())
    assert (behind, woken, wakes) == ([1], [2, 3, 4], 1)


def test_a_long_poll_with_nothing_new_ends_at_its_bound_and_other_epochs_cursors_do_not_wait():
    buffer = KVEventBuffer("w", epoch=5)
    store(buffer, 0, 1)

    async def run() -> tuple[list[int], object]:
        await asyncio.wait_for(buffer.wait_past(2, 0.05), 5.0)  # up to date: the bound ends it
        quiet = seqs(buffer.read_since(2))
        await asyncio.wait_for(buffer.wait_past(7, 60.0), 5.0)  # beyond this epoch: a snapshot is due now
        return quiet, buffer.read_since(7).snapshot

    quiet, snapshot = asyncio.run(run())
    assert quiet == [] and snapshot == (H[0], H[1])
