"""The rollout workers' turn (controller/rollout_turn.py): a validation's `hold` waits for the calls in
flight and no new call starts meanwhile, so busy producer lanes cannot starve it."""

from __future__ import annotations

import threading
import time

from controller.rollout_turn import RolloutTurn


def test_hold_waits_for_calls_in_flight_and_new_calls_wait_for_it():
    turn, events, lock = RolloutTurn(), [], threading.Lock()

    def log(what: str) -> None:
        with lock:
            events.append(what)

    def call(name: str, seconds: float) -> None:
        with turn.generation(5.0, name):
            log(f"{name} start")
            time.sleep(seconds)
            log(f"{name} end")

    first = threading.Thread(target=call, args=("a", 0.3))
    first.start()
    time.sleep(0.05)  # a is in flight
    holder = threading.Thread(target=lambda: (turn.hold(5.0), log("held")))
    holder.start()
    time.sleep(0.05)  # hold is waiting for a: a call started now must wait behind it
    second = threading.Thread(target=call, args=("b", 0.0))
    second.start()
    holder.join(5.0)
    time.sleep(0.1)
    assert events == ["a start", "a end", "held"]  # b has not started while held
    turn.release()
    first.join(5.0)
    second.join(5.0)
    assert events == ["a start", "a end", "held", "b start", "b end"]


def test_hold_times_out_while_a_call_runs_and_leaves_the_turn_usable():
    turn, started = RolloutTurn(), threading.Event()

    def call() -> None:
        with turn.generation(5.0, "a"):
            started.set()
            time.sleep(0.3)

    thread = threading.Thread(target=call)
    thread.start()
    started.wait(5.0)
    assert turn.hold(0.05) is False
    with turn.generation(1.0, "b"):  # a failed hold blocks nothing
        pass
    thread.join(5.0)
    assert turn.hold(1.0) is True
    turn.release()
