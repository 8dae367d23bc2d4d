"""The scheduler with hand-made sequences and a fake runner that only advances ``num_cached``."""

from __future__ import annotations

import pytest

from handler.engine.sampler import RowState
from handler.engine.scheduler import _MIN_PREFILL_TOKENS, Scheduler, SlotMove, StepPlan
from handler.engine.sequence import RequestState, Sequence
from handler.engine.types import GenerationRequest


class NullDetokenizer:
    def push(self, token_id: int) -> tuple[str, bool]:
        return "", False

    def flush(self) -> str:
        return ""


def make_sequence(state: RequestState, index: int) -> Sequence:
    row = RowState(state.request.sampling, list(state.request.prompt_ids), [], None, 0)
    return Sequence(state, index, row, NullDetokenizer(), max_new_tokens=16)  # type: ignore[arg-type]


def request(num_prompt: int, n: int = 1, name: str = "r") -> RequestState:
    return RequestState(GenerationRequest(name, prompt_ids=tuple(range(1, num_prompt + 1)), n=n), make_sequence)


def fake_run(plan: StepPlan) -> None:
    """What ModelRunner._advance does: decoding sequences gain one cached token, prefill chunks their length."""
    for sequence in plan.decode:
        if not sequence.is_prefilling:
            sequence.num_cached += 1
            sequence.output_ids.append(0)
    for sequence, _start, length in plan.prefill:
        sequence.num_cached += length


def chunks(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(s.request.request.request_id, start, length) for s, start, length in plan.prefill]


def test_empty_scheduler_has_no_work() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    assert not scheduler.has_work
    assert scheduler.schedule().is_empty


def test_admits_oldest_first_and_places_in_slot_order() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=512)
    states = [request(5, name=f"r{i}") for i in range(3)]
    for state in states:
        scheduler.add(state)
    plan = scheduler.schedule()
    assert chunks(plan) == [("r0", 0, 5), ("r1", 0, 5), ("r2", 0, 5)]
    assert [s.slot for s in scheduler.slots] == [0, 1, 2]
    assert plan.decode == scheduler.slots
    assert [s.request for s in scheduler.slots] == states
    assert not scheduler.waiting


def test_admission_respects_max_running() -> None:
    scheduler = Scheduler(max_running=2, max_step_tokens=512)
    for i in range(3):
        scheduler.add(request(4, name=f"r{i}"))
    plan = scheduler.schedule()
    assert chunks(plan) == [("r0", 0, 4), ("r1", 0, 4)]
    assert [s.request.request_id for s in scheduler.waiting] == ["r2"]
    fake_run(plan)
    plan = scheduler.schedule()
    assert plan.prefill == []  # still full
    assert len(plan.decode) == 2
    scheduler.remove(scheduler.slots[0])
    plan = scheduler.schedule()
    assert chunks(plan) == [("r2", 0, 4)]


def test_admission_counts_n() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=512)
    scheduler.add(request(4, n=3, name="three"))
    scheduler.add(request(4, n=2, name="two"))
    scheduler.add(request(4, n=1, name="one"))
    plan = scheduler.schedule()
    # "three" reserves 3 of 4; "two" does not fit, and admission is in order (no overtaking)
    assert chunks(plan) == [("three", 0, 4)]
    assert scheduler.num_reserved == 3
    assert [s.request.request_id for s in scheduler.waiting] == ["two", "one"]


def test_prefilling_request_keeps_its_n_reserved_across_chunks() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=_MIN_PREFILL_TOKENS)
    scheduler.add(request(100, n=3, name="long"))
    fake_run(scheduler.schedule())
    assert scheduler.slots[0].is_prefilling
    scheduler.add(request(4, n=2, name="late"))
    plan = scheduler.schedule()
    assert [c[0] for c in chunks(plan)] == ["long"]
    assert scheduler.num_reserved == 3


def test_request_with_n_larger_than_max_running_is_never_admitted() -> None:
    scheduler = Scheduler(max_running=2, max_step_tokens=64)
    scheduler.add(request(4, n=3))
    assert scheduler.schedule().is_empty  # the engine refuses such requests at submit time


def test_token_budget_splits_a_long_prompt_across_steps() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    scheduler.add(request(150, name="long"))
    seen = []
    for _ in range(3):
        plan = scheduler.schedule()
        seen += chunks(plan)
        fake_run(plan)
    # the admitted sequence's own placeholder decode row takes one token of the first step's budget
    assert seen == [("long", 0, 63), ("long", 63, 63), ("long", 126, 24)]
    (sequence,) = scheduler.slots
    assert not sequence.is_prefilling
    assert sequence.num_cached == 150


@pytest.mark.parametrize("num_requests", [1, 3])
def test_step_never_runs_more_than_max_step_tokens(num_requests: int) -> None:
    scheduler = Scheduler(max_running=8, max_step_tokens=64)
    for i in range(num_requests):
        scheduler.add(request(150, name=f"r{i}"))
    for _ in range(4):
        plan = scheduler.schedule()
        # ModelRunner.run processes one row per decode entry (placeholders for prefilling slots too) + the chunks
        assert len(plan.decode) + sum(length for _, _, length in plan.prefill) <= 64
        fake_run(plan)


def test_leftover_budget_goes_to_waiting_requests_and_chunks_resume_first() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    scheduler.add(request(100, name="a"))
    scheduler.add(request(30, name="b"))
    plan = scheduler.schedule()
    assert chunks(plan) == [("a", 0, 63)]
    fake_run(plan)
    plan = scheduler.schedule()
    # budget 64 - 1 slot = 63: "a" finishes its 37 tokens; "b" takes a decode row and 25 of its 30
    assert chunks(plan) == [("a", 63, 37), ("b", 0, 25)]
    fake_run(plan)
    plan = scheduler.schedule()
    assert chunks(plan) == [("b", 25, 5)]


def test_full_decode_batch_still_leaves_a_minimum_prefill_budget() -> None:
    scheduler = Scheduler(max_running=64, max_step_tokens=40)
    for i in range(38):
        scheduler.add(request(1, name=f"s{i}"))
    for _ in range(3):  # each admission costs its prompt token and its slot's decode row
        fake_run(scheduler.schedule())
    assert len(scheduler.slots) == 38
    scheduler.add(request(100, name="new"))
    plan = scheduler.schedule()
    assert chunks(plan) == [("new", 0, _MIN_PREFILL_TOKENS - 1)]


def test_remove_last_needs_no_move() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=512)
    for i in range(3):
        scheduler.add(request(5, name=f"r{i}"))
    fake_run(scheduler.schedule())
    last = scheduler.slots[2]
    assert scheduler.remove(last) is None
    assert last.slot == -1
    assert [s.slot for s in scheduler.slots] == [0, 1]


def test_remove_moves_the_last_slot_into_the_hole() -> None:
    scheduler = Scheduler(max_running=8, max_step_tokens=512)
    for i, size in enumerate([5, 6, 7, 8]):
        scheduler.add(request(size, name=f"r{i}"))
    fake_run(scheduler.schedule())
    fake_run(scheduler.schedule())  # one decode step: num_cached = prompt + 1
    first, last = scheduler.slots[0], scheduler.slots[3]
    move = scheduler.remove(first)
    assert move == SlotMove(src=3, dst=0, length=9)
    assert first.slot == -1
    assert last.slot == 0
    assert [s.request.request.request_id for s in scheduler.slots] == ["r3", "r1", "r2"]
    assert [s.slot for s in scheduler.slots] == [0, 1, 2]
    move = scheduler.remove(scheduler.slots[1])
    assert move == SlotMove(src=2, dst=1, length=8)
    assert [s.request.request.request_id for s in scheduler.slots] == ["r3", "r2"]
    assert [s.slot for s in scheduler.slots] == [0, 1]


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]])
def test_slots_stay_contiguous_under_any_removal_order(order: list[int]) -> None:
    scheduler = Scheduler(max_running=8, max_step_tokens=512)
    for i in range(5):
        scheduler.add(request(3 + i, name=f"r{i}"))
    fake_run(scheduler.schedule())
    by_name = {s.request.request.request_id: s for s in scheduler.slots}
    contents = {s.slot: s.request.request.request_id for s in scheduler.slots}  # a fake cache: slot -> owner
    for i in order:
        sequence = by_name[f"r{i}"]
        hole = sequence.slot
        move = scheduler.remove(sequence)
        if move is not None:
            assert move.dst == hole and move.length == scheduler.slots[hole].num_cached
            contents[move.dst] = contents.pop(move.src)
        else:
            contents.pop(hole)
        assert [s.slot for s in scheduler.slots] == list(range(len(scheduler.slots)))
        assert {s.slot: s.request.request.request_id for s in scheduler.slots} == contents
    assert scheduler.slots == []
    assert not scheduler.has_work


def test_take_cancelled_waiting() -> None:
    scheduler = Scheduler(max_running=1, max_step_tokens=64)
    states = [request(3, name=f"r{i}") for i in range(4)]
    for state in states:
        scheduler.add(state)
    states[1].cancelled.set()
    states[3].cancelled.set()
    assert scheduler.take_cancelled_waiting() == [states[1], states[3]]
    assert list(scheduler.waiting) == [states[0], states[2]]
    assert scheduler.take_cancelled_waiting() == []
