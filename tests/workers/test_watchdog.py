"""The hang watchdog's parts: the deadline policy, the record of calls in flight, the headline.

The end-to-end behaviour (a stopped or stalled worker through the real CLI) is in
tests/e2e/test_watchdog_cli.py; what the diagnosis says about a real process in each state is
in test_hang_report.py.
"""

import asyncio
import os
import time

import pytest

from realrl.api.config import WatchdogConfig
from realrl.workers.hang_report import WorkerProcess
from realrl.workers.heartbeat import HeartbeatResponder
from realrl.workers.watchdog import (
    MEDIAN_WINDOW,
    Call,
    DeadlinePolicy,
    HangError,
    InFlightCalls,
    Overrun,
    Silence,
    Watchdog,
    WatchdogClock,
    describe_hang,
)

CONFIG = WatchdogConfig(deadline_multiple=10.0, min_deadline_s=5.0, warmup_calls=2,
                        warmup_deadline_s=100.0)


def test_each_ranks_first_calls_get_the_warmup_deadline():
    policy = DeadlinePolicy(CONFIG)
    assert policy.deadline_s("actor_gen", rank=0) == 100.0  # no call yet
    policy.observe("actor_gen", 0, 30.0)  # a first call that compiled
    policy.observe("actor_gen", 1, 30.0)
    assert policy.deadline_s("actor_gen", 0) == 100.0  # rank 0 finished 1 < warmup_calls=2
    assert policy.explain("actor_gen", 0) == (
        "watchdog.warmup_deadline_s=100: the rank's call 2, within watchdog.warmup_calls=2")
    policy.observe("actor_gen", 0, 1.0)
    # Rank 0 is past its warm-up: 10 x median(30, 30, 1) = 300 s; rank 1 is not.
    assert (policy.deadline_s("actor_gen", 0), policy.deadline_s("actor_gen", 1)) == (300, 100)


def test_the_deadline_is_a_multiple_of_the_median_with_a_floor():
    policy = DeadlinePolicy(CONFIG)
    policy.observe("actor_gen", 0, 30.0)
    policy.observe("actor_gen", 0, 1.0)
    # 10 x median(30, 1) = 10 x 15.5
    assert policy.deadline_s("actor_gen", 0) == pytest.approx(155.0)
    policy.observe("actor_gen", 0, 2.0)
    # 10 x median(30, 1, 2) = 10 x 2
    assert policy.deadline_s("actor_gen", 0) == pytest.approx(20.0)
    for _ in range(2):
        policy.observe("actor_gen", 0, 0.1)
    # median(30, 1, 2, 0.1, 0.1) = 1 -> 10 s
    assert policy.deadline_s("actor_gen", 0) == pytest.approx(10.0)
    policy.observe("actor_gen", 0, 0.1)
    # median(30, 1, 2, 0.1, 0.1, 0.1) = (0.1 + 1) / 2 = 0.55 -> 5.5 s
    assert policy.deadline_s("actor_gen", 0) == pytest.approx(5.5)
    policy.observe("actor_gen", 0, 0.1)
    # median(..., 0.1 x 4) = 0.1 -> 1 s, below the floor min_deadline_s=5
    assert policy.deadline_s("actor_gen", 0) == 5.0
    assert "median 0.1 s of its last 7 calls" in policy.explain("actor_gen", 0)
    assert policy.deadline_s("actor_train", 0) == 100.0  # each name has its own history


def test_the_median_follows_the_last_calls_only():
    policy = DeadlinePolicy(CONFIG)
    for _ in range(MEDIAN_WINDOW):
        policy.observe("save", 0, 60.0)
    assert policy.deadline_s("save", 0) == 600.0
    for _ in range(MEDIAN_WINDOW // 2 + 1):
        policy.observe("save", 0, 2.0)  # most of the window now: median 2 -> 20 s
    assert policy.deadline_s("save", 0) == 20.0


def test_calls_in_flight_are_recorded_and_only_replies_count_as_durations():
    clock = WatchdogClock()
    calls = InFlightCalls(clock, DeadlinePolicy(CONFIG))
    with calls.track(1, "mfc", "actor_gen", step=3) as call:
        assert calls.by_rank[1] == [call] and call.describe() == "MFC actor_gen (step 3)"
    with pytest.raises(RuntimeError), calls.track(1, "mfc", "actor_train", step=3):
        raise RuntimeError("the request failed")
    assert calls.by_rank[1] == []
    assert "the rank's call 2," in calls.policy.explain("actor_gen", 1)  # the reply counted
    assert "the rank's call 1," in calls.policy.explain("actor_train", 1)  # the failure did not
    with calls.track(0, "exit", "exit", step=None) as call:
        assert call.describe() == "the exit request"
    assert calls.exited == {0}


def test_time_the_master_could_not_run_is_not_held_against_a_call(tmp_path):
    # The master's event loop blocked for 4 s (as in a suspended job, where the workers stop
    # too) while a call with a 3 s deadline was in flight: no overrun, the work finishes.
    config = WatchdogConfig(warmup_deadline_s=3.0, heartbeat_interval_s=0.5)
    watchdog = Watchdog(config, tmp_path, workers={}, secret=b"s" * 32)

    async def work() -> str:
        with watchdog.calls.track(0, "mfc", "actor_gen", step=1):
            await asyncio.sleep(0.1)
            time.sleep(4.0)  # nothing on the master runs meanwhile, not even the watchdog
            await asyncio.sleep(1.5)  # the watchdog looks again (every 0.5 s)
        return "done"

    assert asyncio.run(watchdog.run(work())) == "done"


def test_a_call_past_its_deadline_stops_the_work_with_the_diagnosis(tmp_path):
    # "Worker" 0 is this process: its heartbeat thread answers, with this thread's stack.
    secret = b"s" * 32
    responder = HeartbeatResponder("127.0.0.1", secret)
    worker = WorkerProcess.from_publication(responder.publication())
    config = WatchdogConfig(warmup_deadline_s=1.0, heartbeat_interval_s=0.5)
    watchdog = Watchdog(config, tmp_path, workers={0: worker}, secret=secret)
    cancelled = []

    async def waiting_for_a_late_reply() -> None:
        try:
            with watchdog.calls.track(0, "mfc", "actor_gen", step=1):
                await asyncio.sleep(60.0)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    try:
        with pytest.raises(HangError) as hang:
            asyncio.run(watchdog.run(waiting_for_a_late_reply()))
    finally:
        responder.close()
    assert hang.value.headline.startswith("the hang watchdog stopped the run: MFC actor_gen "
                                          "(step 1) has run ")
    assert cancelled == [True]
    report = hang.value.report_path.read_text()
    assert report.startswith(hang.value.headline)
    assert f"rank 0 (pid {os.getpid()} on {worker.host}): in MFC actor_gen (step 1)" in report
    assert "Thread MainThread (most recent call last)" in report
    # This thread's stack: the event loop, inside this test (a suspended coroutine has no frame)
    assert "in test_a_call_past_its_deadline_stops_the_work_with_the_diagnosis" in report


def test_the_headline_names_each_late_call_its_ranks_and_each_silent_rank():
    policy = DeadlinePolicy(CONFIG)
    train = Call("mfc", "actor_train", 7, started=0.0)
    transfer = Call("transfer", "realloc/actor_gen", 7, started=0.0)
    headline = describe_hang(
        [Silence(2, 130.4, [train])],
        [Overrun(0, train, 140.2, 100.0), Overrun(1, train, 140.0, 100.0),
         Overrun(3, transfer, 101.0, 100.0)],
        WatchdogConfig(), policy,
    )
    assert headline == (
        "the hang watchdog stopped the run: MFC actor_train (step 7) has run 140.2 s on ranks "
        "0, 1, past its deadline of 100.0 s (watchdog.warmup_deadline_s=100: the rank's call 1, "
        "within watchdog.warmup_calls=2); weight transfer realloc/actor_gen (step 7) has run "
        "101.0 s on rank 3, past its deadline of 100.0 s (watchdog.warmup_deadline_s=100: the "
        "rank's call 1, within watchdog.warmup_calls=2); rank 2, in MFC actor_train (step 7), "
        "answered no heartbeat for 130.4 s (watchdog.heartbeat_timeout_s=120)"
    )


@pytest.mark.parametrize(("override", "key"), [
    ({"min_deadline_s": 0.0}, "watchdog.min_deadline_s=0.0` must be > 0"),
    ({"deadline_multiple": 0.5}, "watchdog.deadline_multiple=0.5` must be >= 1"),
    ({"warmup_calls": 0}, "watchdog.warmup_calls=0"),
    ({"heartbeat_interval_s": 10.0, "heartbeat_timeout_s": 15.0},
     "watchdog.heartbeat_timeout_s=15.0` must be at least twice"),
])
def test_watchdog_settings_are_validated_with_the_key_and_a_fix(override, key):
    problems = WatchdogConfig(**override).validate("watchdog")
    assert len(problems) == 1 and key in problems[0], problems
