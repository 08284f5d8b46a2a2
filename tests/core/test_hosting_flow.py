"""The worker side of a call, in one process: where a thread transport hears a call's
outcome, and how the environment gate admits instances with equal and other variables."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.hosting import Actor, Call, EnvGate, Instances, PickleCopy
from hybridflow_dask.errors import CallTimeoutError, CallWithdrawnError


class Echo:
    def where(self) -> tuple[str, str | None]:
        return threading.current_thread().name, os.environ.get("HF_T_GATE")


def _plain(args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
    return args, kwargs, ()


@pytest.fixture
def hosted(monkeypatch):
    monkeypatch.setenv("HF_T_GATE", "the process's")  # put back after the test
    instances = Instances(PickleCopy())
    ref = InstanceRef("flow", 0, Slot(0, "local", "127.0.0.1"))
    init = Call(ref.key, "d", 1, "__init__", (), {})
    instances.construct_now(ref, Echo, {"HF_T_GATE": "rank0"}, init, _plain).result(10)
    yield instances, ref
    instances.stop_all()


def _answer_of(instances: Instances, call: Call) -> tuple[object, BaseException | None, str]:
    """What ``serve_then`` hands its answer, and the thread that called it."""
    heard: list[tuple[object, BaseException | None, str]] = []
    done = threading.Event()

    def answer(value: object, error: BaseException | None) -> None:
        heard.append((value, error, threading.current_thread().name))
        done.set()

    instances.serve_then(call, _plain, None, answer)
    assert done.wait(10)
    assert len(heard) == 1
    return heard[0]


def test_a_served_call_is_answered_once_from_the_instances_own_thread(hosted):
    instances, ref = hosted
    value, error, thread = _answer_of(instances, Call(ref.key, "d", 2, "where", (), {}))
    assert error is None
    assert value == (f"hf-{ref.name}", "rank0")  # ran in its thread, with its variables
    assert thread == f"hf-{ref.name}"  # and the answer came from there, as it returned


def test_a_refused_call_is_answered_at_once_in_the_callers_thread(hosted):
    instances, ref = hosted
    me = threading.current_thread().name
    late = Call(ref.key, "d", 2, "where", (), {}, deadline=time.time() - 1)
    _, error, thread = _answer_of(instances, late)
    assert isinstance(error, CallTimeoutError) and thread == me
    _, error, thread = _answer_of(instances, Call("nobody#0", "d", 1, "where", (), {}))
    assert isinstance(error, LookupError) and thread == me
    # the refused number passed its turn: the next call runs
    value, error, _ = _answer_of(instances, Call(ref.key, "d", 3, "where", (), {}))
    assert error is None and value[1] == "rank0"


def test_the_gate_lets_equal_variables_in_together_and_others_in_turn(monkeypatch):
    monkeypatch.setenv("HF_T_GATE", "the process's")  # put back after the test
    gate = EnvGate()
    a, b = {"HF_T_GATE": "a"}, {"HF_T_GATE": "b"}
    key_a, key_b = frozenset(a.items()), frozenset(b.items())
    gate.enter(key_a, a)
    gate.enter(key_a, a)  # equal variables: in at once, together
    seen: list[str | None] = []

    def other() -> None:
        gate.enter(key_b, b)
        seen.append(os.environ.get("HF_T_GATE"))
        gate.leave()

    waiter = threading.Thread(target=other)
    waiter.start()
    time.sleep(0.2)
    assert seen == [] and os.environ["HF_T_GATE"] == "a"  # b waits while a's calls run
    gate.leave()
    time.sleep(0.1)
    assert seen == []  # one of a's calls is still in
    gate.leave()
    waiter.join(5)
    assert seen == ["b"]  # admitted with its own variables once a's calls left


def test_instances_taking_turns_each_see_only_their_own_variables(monkeypatch):
    monkeypatch.setenv("HF_T_GATE", "the process's")  # put back after the test
    gate = EnvGate()
    wrong: list[tuple[str, str | None]] = []
    turn_of = {name: threading.Lock() for name in "abcd"}
    for lock in turn_of.values():
        lock.acquire()

    def instance(name: str) -> None:
        env = {"HF_T_GATE": name}
        key = frozenset(env.items())
        for _ in range(200):
            gate.enter(key, env, turn_of[name])  # its own reused turn, as an Actor's
            for _ in range(2):  # as it starts, and after others had a chance to run
                if os.environ.get("HF_T_GATE") != name:
                    wrong.append((name, os.environ.get("HF_T_GATE")))
                time.sleep(0.0002)
            gate.leave()

    threads = [threading.Thread(target=instance, args=(name,)) for name in "abcd"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []


@pytest.mark.parametrize("how", ["skip", "stop"])
def test_a_call_failed_while_a_lent_thread_drives_it_wakes_that_thread(how):
    # (Ray's slot actor: its one thread drives the instance's calls. A call withdrawn or
    # dropped from another thread settles its future under the table's lock, and the
    # driving thread's wake-up takes that lock again: it must not deadlock.)
    actor = Actor(InstanceRef("lent", 0, Slot(0, "local", "h")), {}, EnvGate(), own_thread=False)
    later = actor.submit("d", 2, lambda a: "ran")  # waits for call 1, which never comes
    driving = threading.Thread(target=actor.drive, args=(later,), daemon=True)
    driving.start()
    time.sleep(0.1)  # the lent thread sleeps in its table
    failing = threading.Thread(
        target=(lambda: actor.skip("d", 2)) if how == "skip" else actor.stop, daemon=True
    )
    failing.start()
    failing.join(5)
    driving.join(5)
    assert not failing.is_alive() and not driving.is_alive(), "deadlocked"
    with pytest.raises(CallWithdrawnError if how == "skip" else LookupError):
        later.result(0)
