"""The ucx consumer's load slots (connectors/ucx/slots.py) on their own, with real threads: a key's jobs run
at most ``per_key`` at once and in order, another key's job starts at once whatever the first key's do,
idle threads end (and start again), shutdown runs what is queued, and so does a process's exit; and through
:class:`~kvbridge.lifecycle.Transfers`, a job that raises fails its load's blocks. The same machinery
across emulated hosts, with a dead producer: tests/test_hosts_slots.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kvbridge.connectors.ucx import slots as slotsmod

from kvbridge.contract import BlockLoad, BlockSave, WorkerReport
from kvbridge.errors import ClosedError
from kvbridge.lifecycle import Transfers


def _by_source(op: BlockLoad | BlockSave) -> str:
    return str(op.source) if isinstance(op, BlockLoad) else ""


def _load(key: str, rid: str = "r") -> BlockLoad:
    return BlockLoad(rid, (1, 2, 3), source=key)


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_a_stuck_key_holds_its_own_slots_only_and_runs_its_jobs_in_order() -> None:
    slots = slotsmod.Slots("t-stuck", 2, _by_source)
    gate = threading.Event()
    started: list[int] = []
    lock = threading.Lock()

    def stuck(i: int) -> int:
        with lock:
            started.append(i)
        assert gate.wait(10)
        return i

    try:
        futures = [slots.submit(_load("dead"), lambda i=i: stuck(i)) for i in range(5)]
        deadline = time.monotonic() + 5
        while len(started) < 2:
            assert time.monotonic() < deadline, "the stuck key's first jobs did not start"
            time.sleep(0.005)
        # another key's job runs now, while the stuck key's slots are all taken
        assert slots.submit(_load("healthy"), lambda: "ok").result(timeout=2) == "ok"
        time.sleep(0.05)
        assert sorted(started) == [0, 1], "at most per_key jobs of one key at once, the first ones"
        assert slots.threads()["dead"] == 2
        gate.set()
        assert [f.result(timeout=5) for f in futures] == list(range(5))
        assert sorted(started) == list(range(5))
    finally:
        gate.set()
        slots.shutdown()


def test_one_slot_runs_a_keys_jobs_first_in_first_out_and_carries_raises() -> None:
    slots = slotsmod.Slots("t-order", 1, _by_source)
    seen: list[int] = []
    try:
        futures = [slots.submit(_load("p"), lambda i=i: seen.append(i)) for i in range(50)]
        for f in futures:
            f.result(timeout=5)
        assert seen == list(range(50))

        def boom() -> None:
            raise RuntimeError("the producer is gone")

        with pytest.raises(RuntimeError, match="gone"):
            slots.submit(_load("p"), boom).result(timeout=5)
        assert slots.submit(_load("p"), lambda: 7).result(timeout=5) == 7, "a raise does not end the lane"
    finally:
        slots.shutdown()


def test_idle_threads_end_and_the_next_job_starts_one_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slotsmod, "IDLE_S", 0.2)
    slots = slotsmod.Slots("t-idle", 3, _by_source)
    prefix = "kvbridge-t-idle-"
    gate = threading.Event()
    try:
        futures = [slots.submit(_load(f"p{i % 2}"), gate.wait) for i in range(6)]
        time.sleep(0.05)
        assert slots.threads() == {"p0": 3, "p1": 3} and _threads(prefix) == 6
        gate.set()
        for f in futures:
            assert f.result(timeout=5)
        deadline = time.monotonic() + 5
        while slots.threads() or _threads(prefix):
            assert time.monotonic() < deadline, f"idle threads did not end: {slots.threads()}"
            time.sleep(0.02)
        assert not slots._lanes, "a lane with no thread and nothing queued is forgotten"
        assert slots.submit(_load("p0"), lambda: "again").result(timeout=5) == "again"
        assert slots.threads() in ({"p0": 1}, {})  # the fresh thread, unless it already idled out
    finally:
        gate.set()
        slots.shutdown()


def test_shutdown_runs_what_is_queued_then_ends_every_thread() -> None:
    slots = slotsmod.Slots("t-close", 1, _by_source)
    gate = threading.Event()
    ran: list[str] = []
    first = slots.submit(_load("a"), lambda: (gate.wait(5), ran.append("a0")))
    queued = [slots.submit(_load(k), lambda k=k: ran.append(k)) for k in ("a", "b")]
    closer = threading.Thread(target=slots.shutdown)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive(), "shutdown waits for the job still running"
    with pytest.raises(ClosedError):
        slots.submit(_load("c"), lambda: None)
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert first.done() and all(f.done() for f in queued)
    assert sorted(ran) == ["a", "a0", "b"] and ran.index("a0") < ran.index("a")
    assert _threads("kvbridge-t-close-") == 0


def test_transfers_on_slots_fail_a_raising_loads_blocks_and_close_by_the_jobs_end() -> None:
    t = Transfers("t-transfers", pool=slotsmod.Slots("t-transfers", 2, _by_source))
    gate = threading.Event()

    def fails() -> list[int]:
        raise ConnectionError("no answer")

    t.track(t.run(_load("dead", "x"), fails))
    t.track(t.run(_load("dead", "y"), lambda: (gate.wait(5), [3])[1]))
    t.track(t.run(_load("ok", "z"), lambda: None))
    assert t.wait(["x", "z"], timeout=5)
    assert t.poll() == WorkerReport(frozenset({"x", "z"}), failed_blocks=frozenset({1, 2, 3}))
    closer = threading.Thread(target=t.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive(), "close waits for the load in flight"
    gate.set()
    closer.join(5)
    assert not closer.is_alive() and _threads("kvbridge-t-transfers-") == 0


def test_a_process_that_never_shut_its_slots_down_lets_the_running_job_end_at_exit(tmp_path: Path) -> None:
    """The threads are daemons (an idle one never holds the exit up), yet a job still running when the
    interpreter exits (a load writing into the KV) ends before it does."""
    done = tmp_path / "done"
    script = (
        "import threading, time\n"
        "from kvbridge.connectors.ucx.slots import Slots\n"
        "from kvbridge.contract import BlockLoad\n"
        "slots = Slots('exit', 2, lambda op: 'p')\n"
        "started = threading.Event()\n"
        f"def job():\n    started.set()\n    time.sleep(0.5)\n    open({str(done)!r}, 'w').write('ok')\n"
        "slots.submit(BlockLoad('r', (1,)), job)\n"
        "slots.submit(BlockLoad('s', (2,)), lambda: None)\n"  # an idle thread once this ends
        "started.wait(10)\n"
    )
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert done.read_text() == "ok"
    assert time.monotonic() - t0 < slotsmod.IDLE_S, "the idle thread held the exit up"
