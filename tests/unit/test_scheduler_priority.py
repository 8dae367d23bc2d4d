"""The scheduler's priorities (``GenerationRequest.priority``, lower first): admission, prefill, preemption, and the
bound on how long better priorities may pass a request."""

from __future__ import annotations

from handler.engine.core.request import RequestState
from handler.engine.lean.scheduler import MAX_PASSED_STEPS, Scheduler
from handler.engine.types import GenerationRequest
from tests.unit.test_scheduler import TokenSpace, chunks, fake_run, make_sequence


def request(num_prompt: int, name: str, priority: int | None = None) -> RequestState:
    return RequestState(GenerationRequest(name, prompt_ids=tuple(range(1, num_prompt + 1)), priority=priority),
                        make_sequence)


def names(states) -> list[str]:
    return [s.request.request_id for s in states]


def test_a_better_priority_behind_a_full_queue_is_admitted_first() -> None:
    scheduler = Scheduler(max_running=1, max_step_tokens=512)
    scheduler.add(request(5, "holder"))
    fake_run(scheduler.schedule())
    for i in range(4):
        scheduler.add(request(5, f"low{i}", priority=5))
    scheduler.add(request(5, "urgent", priority=-1))
    assert scheduler.schedule().prefill == []  # the one slot is held
    scheduler.remove(scheduler.running[0])
    assert chunks(scheduler.schedule()) == [("urgent", 0, 5)]
    scheduler.remove(scheduler.running[0])
    assert chunks(scheduler.schedule()) == [("low0", 0, 5)]  # then the oldest of the rest


def test_prefill_goes_to_the_better_priority_before_the_cheaper_prompt() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    scheduler.add(request(100, "urgent-long", priority=0))
    scheduler.add(request(30, "short", priority=1))
    plan = scheduler.schedule()
    # 63 tokens after its decode row: the urgent one's quarter (16), then the urgent one again before the cheaper
    # prompt of a worse priority (47); nothing is left to admit "short" with
    assert chunks(plan) == [("urgent-long", 0, 63)]
    assert names(scheduler.waiting) == ["short"]


def test_equal_priorities_keep_the_short_chats_first_rule() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    scheduler.add(request(100, "a", priority=3))
    scheduler.add(request(30, "b", priority=3))
    # the oldest's quarter, then the prompt that completes; a newcomer's first token keeps the step short
    assert sorted(chunks(scheduler.schedule())) == [("a", 0, 16), ("b", 0, 30)]


def test_a_stream_of_better_priorities_passes_a_request_for_a_bounded_number_of_steps() -> None:
    scheduler = Scheduler(max_running=1, max_step_tokens=512)
    patient = request(5, "patient", priority=9)
    scheduler.add(patient)
    scheduler.add(request(5, "urgent-0", priority=0))
    admitted = []
    for step in range(3 * MAX_PASSED_STEPS):
        scheduler.add(request(5, f"urgent-{step + 1}", priority=0))  # a better one always waits
        plan = scheduler.schedule()
        admitted += [s.request.request.request_id for s, start, _length in plan.prefill if start == 0]
        fake_run(plan)
        for sequence in list(scheduler.running):
            scheduler.remove(sequence)  # each finishes after its first token
        if "patient" in admitted:
            break
    assert "patient" in admitted
    assert admitted.index("patient") == MAX_PASSED_STEPS  # passed this many times, then first


def test_memory_preempts_the_worst_priority_first() -> None:
    scheduler = Scheduler(max_running=8, max_step_tokens=512)
    scheduler.space = TokenSpace(30)
    urgent, background = request(10, "urgent", priority=0), request(10, "background", priority=4)
    scheduler.add(background)   # older, but the worse priority
    scheduler.add(urgent)
    for _ in range(8):
        fake_run(scheduler.schedule())
    assert names(s.request for s in scheduler.preempted) == ["background"]
    assert names(s.request for s in scheduler.running) == ["urgent"]
