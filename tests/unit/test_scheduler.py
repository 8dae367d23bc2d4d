"""The scheduler with hand-made sequences and a fake runner that only advances ``num_cached``."""

from __future__ import annotations

import pytest

from handler.engine.core.request import RequestState, Sequence
from handler.engine.core.sampler import RowState
from handler.engine.lean.scheduler import _MIN_PREFILL_TOKENS, Scheduler
from handler.engine.runners.base import StepPlan, advance
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
    """ModelRunner's bookkeeping (``advance``), and a token sampled for every decoding sequence."""
    decoding = [s for s in plan.decode if not s.is_prefilling]
    advance(plan)
    for sequence in decoding:
        sequence.output_ids.append(0)


def chunks(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(s.request.request.request_id, start, length) for s, start, length in plan.prefill]


def test_empty_scheduler_has_no_work() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    assert not scheduler.has_work
    assert scheduler.schedule().is_empty


def test_admits_oldest_first_among_equals() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=512)
    states = [request(5, name=f"r{i}") for i in range(3)]
    for state in states:
        scheduler.add(state)
    plan = scheduler.schedule()
    assert chunks(plan) == [("r0", 0, 5), ("r1", 0, 5), ("r2", 0, 5)]
    assert [s.request for s in scheduler.running] == states
    assert plan.decode == scheduler.running
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
    scheduler.remove(scheduler.running[0])
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
    assert scheduler.running[0].is_prefilling
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
    (sequence,) = scheduler.running
    assert not sequence.is_prefilling
    assert sequence.num_cached == 150


def test_chunks_end_on_whole_blocks_where_they_cross_one() -> None:
    """With ``chunk_align`` (the lean model's KEY_BLOCK of 64), a chunk that is not the prompt's last and crosses a
    multiple of 64 ends at the last one it crosses; one that crosses none, and the last, keep their length."""
    scheduler = Scheduler(max_running=4, max_step_tokens=200)
    scheduler.chunk_align = 64
    scheduler.add(request(300, name="long"))
    seen = []
    while scheduler.running == [] or scheduler.running[0].is_prefilling:
        plan = scheduler.schedule()
        seen += chunks(plan)
        fake_run(plan)
    assert seen == [("long", 0, 192), ("long", 192, 108)]  # 199 tokens of budget: cut back to 192
    scheduler = Scheduler(max_running=4, max_step_tokens=48)
    scheduler.chunk_align = 64
    scheduler.add(request(100, name="short steps"))
    first = scheduler.schedule()
    fake_run(first)
    second = scheduler.schedule()
    assert chunks(first) == [("short steps", 0, 47)]  # crosses no multiple of 64: kept
    assert chunks(second) == [("short steps", 47, 17)]  # 48 tokens would cross 64: ends there


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


def test_a_short_prompt_is_prefilled_before_a_long_one_and_the_oldest_keeps_a_share() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    scheduler.add(request(100, name="a"))
    scheduler.add(request(30, name="b"))
    plan = scheduler.schedule()
    # budget 64: "a" (oldest) gets a quarter first, "b" (cheapest) all of its 30; "b" gets its first token from this
    # step, so "a" gets no more than its quarter (the step stays short)
    assert sorted(chunks(plan)) == [("a", 0, 16), ("b", 0, 30)]
    fake_run(plan)
    assert not scheduler.running[1].is_prefilling  # "b" decodes from the next step
    plan = scheduler.schedule()
    assert chunks(plan) == [("a", 16, 62)]  # no new request: "a" takes the whole budget less the two decode rows


def first_token_steps(scheduler: Scheduler, arrivals: dict[int, list[RequestState]], steps: int) -> dict[str, int]:
    """Run ``steps`` steps, adding ``arrivals[step]`` before each; the step at which each request's prompt completes
    (its first token), by name, and each step's prefill as ``chunks``."""
    first: dict[str, int] = {}
    for step in range(steps):
        for state in arrivals.get(step, []):
            scheduler.add(state)
        plan = scheduler.schedule()
        fake_run(plan)
        for sequence, start, length in plan.prefill:
            if start + length == sequence.prefill_target:
                first.setdefault(sequence.request.request.request_id, step)
    return first


def test_a_short_request_gets_its_first_token_from_the_next_step_whatever_long_prompts_prefill() -> None:
    """Eight 7,000-token prompts prefilling (chunks deep in them cost their attention too), then a short chat: its
    prompt is computed in the first step after it arrives, before any long prompt's first token, and that step
    carries no unfinished prefill but the oldest prompt's quarter of the budget."""
    scheduler = Scheduler(max_running=16, max_step_tokens=512)
    scheduler.attention_tokens = 3072  # the embedded model's (``family.attention_tokens``)
    longs = [request(7000, name=f"long{i}") for i in range(8)]
    for state in longs:
        scheduler.add(state)
    for _ in range(12):  # the first long prompt is well into its prefill
        fake_run(scheduler.schedule())
    scheduler.add(request(40, name="short"))
    plan = scheduler.schedule()
    fake_run(plan)
    (short,) = [s for s, _start, _length in plan.prefill if s.request.request.request_id == "short"]
    assert not short.is_prefilling  # its prompt is complete: the step's logits give its first token
    unfinished = [(s, start, length) for s, start, length in plan.prefill if s.is_prefilling]
    quarter = (512 - 9) // 4
    assert len(unfinished) <= 1 and all(scheduler._chunk_cost(start, length) <= quarter
                                        for _s, start, length in unfinished)
    assert all(s.is_prefilling for state in longs for s in state.sequences)  # no long prompt has a token yet
    # the next step has no new request: the long prompts take the whole budget again
    plan = scheduler.schedule()
    assert sum(scheduler._chunk_cost(start, length) for _s, start, length in plan.prefill) > 512 - 10 - 64


def test_first_tokens_come_in_order_of_prompt_length_and_shorts_in_one_step_each() -> None:
    """Short requests arriving over the prefill of two long prompts each get their first token from the step
    after they arrive; the long prompts' first tokens come after all of theirs, in steps counted from the budget."""
    scheduler = Scheduler(max_running=16, max_step_tokens=128)
    arrivals = {0: [request(2000, name="long-a"), request(3000, name="long-b")]}
    arrivals |= {step: [request(20 + step, name=f"short{step}")] for step in (2, 5, 6, 11, 30)}
    first = first_token_steps(scheduler, arrivals, 60)
    assert {name: first[name] for name in first if name.startswith("short")} == {
        "short2": 2, "short5": 5, "short6": 6, "short11": 11, "short30": 30}
    # the long prompts: the cheaper first, each after as many steps as its tokens take at about 125 a step (the
    # budget less the decode rows), plus under one step for each short step that held them to a quarter
    assert 2000 // 125 <= first["long-a"] < 2000 // 125 + 4 < first["long-b"]
    assert 5000 // 125 <= first["long-b"] <= 5000 // 125 + 5


def test_a_step_that_completes_a_new_prompt_beyond_the_oldests_quarter_stays_short() -> None:
    """The oldest work is itself a new prompt longer than its quarter: it completes from the cheapest-first pass,
    and the long prompt that arrived with it waits for the next step."""
    scheduler = Scheduler(max_running=4, max_step_tokens=512)
    scheduler.add(request(200, name="short"))
    scheduler.add(request(5000, name="long"))
    plan = scheduler.schedule()
    assert chunks(plan) == [("short", 0, 200)]
    fake_run(plan)
    assert chunks(scheduler.schedule()) == [("long", 0, 510)]


def test_a_prompt_that_fits_the_budget_by_its_cost_completes_in_one_step() -> None:
    """Tokens and cost are not mixed up: a 300-token prompt costs 329 with its attention, which fits a 512 budget,
    so it is computed in one step rather than cut at 300 cost units."""
    scheduler = Scheduler(max_running=4, max_step_tokens=512)
    scheduler.attention_tokens = 3072
    scheduler.add(request(300, name="p"))
    assert scheduler._chunk_cost(0, 300) > 300
    assert chunks(scheduler.schedule()) == [("p", 0, 300)]


def test_a_short_request_waits_a_step_not_a_long_prefill() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=64)
    scheduler.add(request(7000, name="long"))
    fake_run(scheduler.schedule())
    scheduler.add(request(20, name="short"))
    plan = scheduler.schedule()
    assert ("short", 0, 20) in chunks(plan)
    assert sum(length for _s, _start, length in plan.prefill) + len(plan.decode) <= 64


def test_a_stream_of_short_requests_cannot_starve_the_oldest() -> None:
    scheduler = Scheduler(max_running=64, max_step_tokens=64)
    scheduler.add(request(500, name="long"))
    done = 0
    for step in range(40):
        scheduler.add(request(40, name=f"s{step}"))
        plan = scheduler.schedule()
        done += sum(length for s, _start, length in plan.prefill if s.request.request.request_id == "long")
        fake_run(plan)
        for sequence in [s for s in scheduler.running if s.output_ids]:
            scheduler.remove(sequence)  # short ones finish after one token
    assert done == 500


def test_full_decode_batch_still_leaves_a_minimum_prefill_budget() -> None:
    scheduler = Scheduler(max_running=64, max_step_tokens=40)
    for i in range(38):
        scheduler.add(request(1, name=f"s{i}"))
    for _ in range(3):  # each admission costs its prompt token and its slot's decode row
        fake_run(scheduler.schedule())
    assert len(scheduler.running) == 38
    scheduler.add(request(100, name="new"))
    plan = scheduler.schedule()
    assert chunks(plan) == [("new", 0, _MIN_PREFILL_TOKENS - 1)]


class TokenSpace:
    """A KV space of ``capacity`` positions: a sequence holds exactly the positions it asked for."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[Sequence, int] = {}

    def fits(self, length: int, count: int = 1) -> bool:
        return sum(self.held.values()) + length * count <= self.capacity

    def place(self, owner: Sequence, length: int) -> bool:
        if not self.fits(length):
            return False
        self.held[owner] = length
        return True

    def grow(self, owner: Sequence, length: int) -> bool:
        if length <= self.held[owner]:
            return True
        if sum(self.held.values()) - self.held[owner] + length > self.capacity:
            return False
        self.held[owner] = length
        return True

    def free(self, owner: Sequence) -> None:
        self.held.pop(owner)

    def sort_key(self, owner: Sequence) -> tuple[int, int]:
        return owner.order


def test_admission_waits_for_memory_and_nothing_newer_passes_the_oldest() -> None:
    scheduler = Scheduler(max_running=8, max_step_tokens=512)
    scheduler.space = TokenSpace(100)
    scheduler.add(request(60, name="big"))
    fake_run(scheduler.schedule())
    scheduler.add(request(50, name="next"))   # 51 positions: does not fit beside big's 61
    scheduler.add(request(5, name="small"))   # would fit, but is newer than "next"
    plan = scheduler.schedule()
    assert chunks(plan) == [] and [s.request.request_id for s in scheduler.waiting] == ["next", "small"]
    scheduler.remove(scheduler.running[0])
    plan = scheduler.schedule()
    assert sorted(chunks(plan)) == [("next", 0, 50), ("small", 0, 5)]


def test_growth_past_the_budget_preempts_the_newest_which_resumes_with_its_output() -> None:
    scheduler = Scheduler(max_running=8, max_step_tokens=512)
    scheduler.space = TokenSpace(30)
    old, new = request(10, name="old"), request(10, name="new")
    scheduler.add(old)
    scheduler.add(new)
    for _ in range(8):  # prefill (11 positions each), then decode until both no longer fit in 30
        fake_run(scheduler.schedule())
    first, second = old.sequences[0], new.sequences[0]
    assert scheduler.preempted == [second] and scheduler.running == [first]
    assert scheduler.num_preemptions == 1
    assert second.kv_slot is None and second.num_cached == 0
    generated = list(second.output_ids)
    assert generated  # it had decoded before it gave way
    scheduler.remove(first)
    plan = scheduler.schedule()
    # it recomputes its prompt and what it generated; that prefill's last logits give its next token
    assert chunks(plan) == [("new", 0, 10 + len(generated))]
    assert second.prefill_target == 10 + len(generated)
    fake_run(plan)
    assert not second.is_prefilling and not second.resuming


def test_a_sequence_that_grows_with_nothing_newer_to_preempt_gives_way_itself() -> None:
    scheduler = Scheduler(max_running=8, max_step_tokens=512)
    scheduler.space = TokenSpace(12)
    scheduler.add(request(10, name="only"))
    fake_run(scheduler.schedule())  # prompt: 11 positions held
    fake_run(scheduler.schedule())  # decode at position 10: 11
    fake_run(scheduler.schedule())  # at 11: 12
    scheduler.schedule()            # 13 do not fit: it is the newest, so it is preempted
    assert [s.request.request.request_id for s in scheduler.preempted] == ["only"]


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


def test_chunks_deep_in_a_long_prompt_are_shorter_by_their_attention_cost() -> None:
    scheduler = Scheduler(max_running=4, max_step_tokens=512)
    scheduler.attention_tokens = 1000  # a token's attention over 1,000 keys costs as much as its other work
    scheduler.add(request(8000, name="long"))
    lengths = []
    while scheduler.running == [] or scheduler.running[0].is_prefilling:
        plan = scheduler.schedule()
        (chunk,) = plan.prefill
        sequence, start, length = chunk
        assert scheduler._chunk_cost(start, length) <= 511  # the budget less the sequence's own decode row
        lengths.append(length)
        fake_run(plan)
    assert lengths[0] > 300 and lengths[-2] < 80  # early chunks near the budget, late ones a fraction of it
    assert sum(lengths) == 8000


def test_each_admitted_request_reports_how_long_it_waited_from_its_intake() -> None:
    """``vllm:request_queue_time_seconds``: one wait per request, when it gets its slot (not while it waits)."""
    scheduler = Scheduler(max_running=1, max_step_tokens=512)
    first, second = request(4, name="r0"), request(4, name="r1")
    second.queued_at -= 5.0  # it came in 5 s ago
    for state in (second, first):
        scheduler.add(state)
    scheduler.schedule()
    [waited] = scheduler.queue_times
    assert 5.0 <= waited < 60  # the second is still waiting: not counted
    scheduler.queue_times.clear()
    scheduler.remove(scheduler.running[0])
    scheduler.schedule()
    assert len(scheduler.queue_times) == 1
