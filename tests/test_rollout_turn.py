"""The rollout workers' turn (controller/weight_publisher.py): a validation's `hold` waits for the calls in
flight and no new call starts meanwhile, so busy producer lanes cannot starve it."""

from __future__ import annotations

import threading
import time

from controller.weight_publisher import RolloutTurn


def test_hold_waits_for_calls_in_flight_and_new_calls_wait_for_it():
    turn, events, lock = RolloutTurn(), [], threading.Lock()
    a_started, a_may_end = threading.Event(), threading.Event()

    def log(what: str) -> None:
        with lock:
            events.append(what)

    def call_a() -> None:
        with turn.generation(5.0, "a"):
            log("a start")
            a_started.set()
            a_may_end.wait(5.0)
            log("a end")

    def call_b() -> None:
        with turn.generation(5.0, "b"):
            log("b start")

    first = threading.Thread(target=call_a)
    first.start()
    assert a_started.wait(5.0)
    holder = threading.Thread(target=lambda: turn.hold(5.0) and log("held"))
    holder.start()
    deadline = time.monotonic() + 5.0
    while not turn._hold_wanted and time.monotonic() < deadline:  # hold is waiting for a
        time.sleep(0.005)
    second = threading.Thread(target=call_b)  # a call started now must wait behind the hold
    second.start()
    time.sleep(0.1)
    assert events == ["a start"]  # neither the hold nor b while a runs
    a_may_end.set()
    holder.join(5.0)
    time.sleep(0.1)
    assert events == ["a start", "a end", "held"]  # b has not started while held
    turn.release()
    first.join(5.0)
    second.join(5.0)
    assert events == ["a start", "a end", "held", "b start"]


def test_hold_times_out_while_a_call_runs_and_leaves_the_turn_usable():
    turn, started, may_end = RolloutTurn(), threading.Event(), threading.Event()

    def call() -> None:
        with turn.generation(5.0, "a"):
            started.set()
            may_end.wait(5.0)

    thread = threading.Thread(target=call)
    thread.start()
    started.wait(5.0)
    assert turn.hold(0.05) is False
    with turn.generation(1.0, "b"):  # a failed hold blocks nothing
        pass
    may_end.set()
    thread.join(5.0)
    assert turn.hold(1.0) is True
    turn.release()
