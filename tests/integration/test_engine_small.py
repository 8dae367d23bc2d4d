"""The real engine with the embedded model (fp32, not quantised), loaded once for the module.

Short generations only: batching invariance, seeded n > 1, stop strings, length limits, ignore_eos, cancel,
and chunked prefill against unchunked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from handler.engine.runners.model_runner import ModelRunner
from handler.engine.types import FinishReason, GenerationRequest, SamplingParams, StopConditions, TokenEvent
from handler.prompt.renderer import PromptRenderer
from tests.integration.conftest import make_engine

NEAR_TIE = 0.05

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
]


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    events: list[TokenEvent] = field(default_factory=list)
    finish: TokenEvent | None = None


def collect(handle) -> dict[int, Choice]:
    choices: dict[int, Choice] = {}
    for event in handle:
        choice = choices.setdefault(event.index, Choice())
        choice.events.append(event)
        choice.text += event.text
        if event.token_id is not None:
            choice.token_ids.append(event.token_id)
        if event.finish_reason is not None:
            choice.finish = event
    return choices


def chat_ids(renderer: PromptRenderer, text: str) -> tuple[int, ...]:
    return tuple(renderer.render_chat([{"role": "user", "content": text}]))


def greedy(name: str, prompt_ids: tuple[int, ...], max_new_tokens: int = 6, **stop) -> GenerationRequest:
    return GenerationRequest(name, prompt_ids, stop=StopConditions(max_new_tokens=max_new_tokens, **stop),
                             num_top_logprobs=2)


def assert_same_or_near_tie(a: Choice, b: Choice) -> None:
    """Same greedy tokens, or they part at a position where the top two logprobs are within NEAR_TIE (fp32 noise)."""
    if a.token_ids == b.token_ids:
        return
    first = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y)
    for choice in (a, b):
        top = [e for e in choice.events if e.token_id is not None][first].top_logprobs
        assert top[0].logprob - top[1].logprob < NEAR_TIE, (first, a.token_ids, b.token_ids)


def test_concurrent_greedy_equals_alone(engine, renderer) -> None:
    requests = [greedy(f"p{i}", chat_ids(renderer, p)) for i, p in enumerate(PROMPTS)]
    alone = [collect(engine.submit(r))[0] for r in requests]
    handles = [engine.submit(r) for r in requests]
    together = [collect(h)[0] for h in handles]
    for a, b in zip(alone, together, strict=True):
        assert a.finish is not None and b.finish is not None
        assert a.finish.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
        assert_same_or_near_tie(a, b)
        assert len(b.token_ids) == b.finish.num_generated_tokens
    assert len({tuple(a.token_ids) for a in alone}) == len(PROMPTS)  # distinct prompts, distinct answers
    # the text is the detokenised tokens (no EOS text)
    assert alone[0].text == renderer.tokenizer.decode(alone[0].token_ids, skip_special_tokens=True)


def test_n3_seeded_repeats_exactly(engine, renderer) -> None:
    def run(seed: int) -> dict[int, Choice]:
        request = GenerationRequest("n3", chat_ids(renderer, "Tell me a story."),
                                    sampling=SamplingParams(temperature=1.0, seed=seed), n=3,
                                    stop=StopConditions(max_new_tokens=6, ignore_eos=True))
        return collect(engine.submit(request))

    first, again = run(1234), run(1234)
    assert sorted(first) == [0, 1, 2]
    for index in range(3):
        assert first[index].finish.finish_reason is FinishReason.LENGTH
        assert len(first[index].token_ids) == 6
        assert first[index].token_ids == again[index].token_ids
        assert first[index].text == again[index].text
    assert len({tuple(first[i].token_ids) for i in range(3)}) > 1   # choices differ from one another
    num_prompt = len(chat_ids(renderer, "Tell me a story."))
    assert all(first[i].finish.num_prompt_tokens == num_prompt for i in range(3))


def test_stop_string_ends_with_stop_and_is_not_in_text(engine, renderer) -> None:
    prompt = chat_ids(renderer, "Write a short sentence about dogs.")
    base = collect(engine.submit(greedy("base", prompt, 8, ignore_eos=True)))[0]
    assert len(base.text) > 12
    stop = base.text[6:10]  # a string from the middle of the answer (it may span tokens)
    cut = base.text[: base.text.find(stop)]
    stopped = collect(engine.submit(greedy("stop", prompt, 8, ignore_eos=True, stop_strings=(stop, "qqqzzz"))))[0]
    assert stopped.finish.finish_reason is FinishReason.STOP
    assert stopped.text == cut
    assert stop not in stopped.text
    assert len(stopped.token_ids) < len(base.token_ids)
    assert stopped.token_ids == base.token_ids[: len(stopped.token_ids)]


def test_max_new_tokens_gives_length_with_exactly_that_many(engine, renderer) -> None:
    prompt = chat_ids(renderer, "Write a long essay about the history of Rome.")
    (choice,) = collect(engine.submit(greedy("len", prompt, 7))).values()
    assert choice.finish.finish_reason is FinishReason.LENGTH
    assert len(choice.token_ids) == 7
    assert choice.finish.num_generated_tokens == 7
    assert choice.finish.num_prompt_tokens == len(prompt)


def test_ignore_eos_keeps_generating(engine, renderer, tokenizer) -> None:
    prompt = chat_ids(renderer, "Is the sky blue? Answer yes or no.")  # greedy: "No." then EOS
    (short,) = collect(engine.submit(greedy("eos", prompt, 12))).values()
    assert short.finish.finish_reason is FinishReason.EOS
    eos_at = len(short.token_ids) - 1
    assert short.token_ids[-1] == tokenizer.eos_token_id
    assert short.finish.text == ""  # EOS releases no text
    assert eos_at + 1 < 12
    (long,) = collect(engine.submit(greedy("noeos", prompt, eos_at + 3, ignore_eos=True))).values()
    assert long.finish.finish_reason is FinishReason.LENGTH
    assert len(long.token_ids) == eos_at + 3
    assert long.token_ids[: eos_at + 1] == short.token_ids  # it went straight past the EOS


def test_cancel_ends_with_abort_while_another_completes(engine, renderer) -> None:
    long_request = GenerationRequest("long", chat_ids(renderer, "Count from one to one thousand."),
                                     stop=StopConditions(max_new_tokens=400, ignore_eos=True))
    short_request = greedy("short", chat_ids(renderer, "Say hello."), 6, ignore_eos=True)
    long_handle, short_handle = engine.submit(long_request), engine.submit(short_request)
    events = iter(long_handle)
    for _ in range(3):
        assert next(events).finish_reason is None
    long_handle.cancel()
    rest = list(events)
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert all(e.finish_reason is None for e in rest[:-1])
    assert 3 + len(rest) < 100  # ended by the cancel within a few steps, not by its 400 tokens
    (short,) = collect(short_handle).values()
    assert short.finish.finish_reason is FinishReason.LENGTH
    assert len(short.token_ids) == 6


def test_cancel_before_start_aborts(engine, renderer) -> None:
    handle = engine.submit(greedy("early", chat_ids(renderer, "Hi"), 10))
    handle.cancel()
    choices = collect(handle)
    # cancelled while waiting (ABORT with no tokens) or after a step or two: ABORT either way, promptly
    assert choices[0].finish.finish_reason is FinishReason.ABORT
    assert len(choices[0].token_ids) < 10


def test_chunked_prefill_matches_unchunked(engine, loaded, renderer) -> None:
    text = ("The library opened at nine. Readers came in from the rain, shook their umbrellas, and went to the "
            "shelves they knew. ") * 6 + "Summarise the paragraph above in one sentence."
    prompt = chat_ids(renderer, text)
    assert 150 < len(prompt) < 300
    unchunked = collect(engine.submit(greedy("whole", prompt)))[0]
    chunked_engine = make_engine(loaded, max_step_tokens=64)
    try:
        chunked = collect(chunked_engine.submit(greedy("chunks", prompt)))[0]
    finally:
        chunked_engine.stop()
    assert chunked.finish.finish_reason is unchunked.finish.finish_reason
    assert_same_or_near_tie(unchunked, chunked)
    assert chunked.events[0].logprob == pytest.approx(unchunked.events[0].logprob, abs=1e-3)


class StepWatch(ModelRunner):
    """The real runner, recording each step's prefill chunks ``(request id, start, length, completes)``; it holds
    the step in which ``hold`` first says so until ``release`` is set (``held`` is set meanwhile)."""

    hold = staticmethod(lambda chunks: False)
    held: threading.Event
    release: threading.Event
    steps: list

    def run(self, plan):
        chunks = [(s.request.request.request_id, start, length, start + length == s.prefill_target)
                  for s, start, length in plan.prefill]
        self.steps.append(chunks)
        if not self.held.is_set() and self.hold(chunks):
            self.held.set()
            assert self.release.wait(60)
        return super().run(plan)


def test_a_short_chat_gets_its_first_token_from_the_step_after_it_arrives(loaded, renderer) -> None:
    """A ~400-token prompt prefilling in 64-token steps; a short chat submitted while one of those steps runs: its
    prompt is computed in the next step, which carries no more of the long prompt than the oldest's quarter, and
    its first token comes before the long prompt's (the scheduler's bound, counted in steps, not timed)."""
    text = ("The library opened at nine. Readers came in from the rain, shook their umbrellas, and went to the "
            "shelves they knew. ") * 14 + "Summarise the paragraph above in one sentence."
    long_prompt = chat_ids(renderer, text)
    assert 350 < len(long_prompt) < 450
    StepWatch.hold = staticmethod(lambda chunks: any(name == "long" and start >= 128 for name, start, *_ in chunks))
    StepWatch.held, StepWatch.release, StepWatch.steps = threading.Event(), threading.Event(), []
    engine = make_engine(loaded, max_step_tokens=64, runner_class=StepWatch)
    try:
        long_handle = engine.submit(greedy("long", long_prompt, max_new_tokens=2))
        assert StepWatch.held.wait(60)
        step = len(StepWatch.steps) - 1        # the step in progress when the short chat arrives
        short_handle = engine.submit(greedy("short", chat_ids(renderer, "Hi!"), max_new_tokens=2))
        StepWatch.release.set()
        short, long = collect(short_handle)[0], collect(long_handle)[0]
    finally:
        engine.stop()
    assert short.finish is not None and long.finish is not None
    steps = StepWatch.steps[step + 1:]
    first = {name: next(i for i, chunks in enumerate(steps) if (name, True) in [(c[0], c[3]) for c in chunks])
             for name in ("short", "long")}
    assert first["short"] == 0 < first["long"]      # the very next step; the long prompt's token after it
    assert all(length <= 64 // 4 for name, _start, length, _done in steps[0] if name == "long")


def test_a_row_whose_sampling_fails_ends_alone(engine, renderer, monkeypatch) -> None:
    """A request whose sampling raises ends with an error event; its batch neighbour finishes normally."""
    import handler.engine.lean.steps as engine_module

    real_sample = engine_module.sample

    def failing_sample(logits, rows):
        if any(row.params.seed == 666 for row in rows):
            raise RuntimeError("probability tensor contains inf")
        return real_sample(logits, rows)

    monkeypatch.setattr(engine_module, "sample", failing_sample)
    doomed = GenerationRequest("doomed", chat_ids(renderer, "Name a colour."),
                               sampling=SamplingParams(temperature=1.0, seed=666),
                               stop=StopConditions(max_new_tokens=8, ignore_eos=True))
    healthy = greedy("healthy", chat_ids(renderer, "Name a fruit."), max_new_tokens=8, ignore_eos=True)
    handles = [engine.submit(doomed), engine.submit(healthy)]
    doomed_events, healthy_events = (list(h) for h in handles)
    assert doomed_events[-1].finish_reason is FinishReason.ERROR and "sampling failed" in doomed_events[-1].error
    assert healthy_events[-1].finish_reason is FinishReason.LENGTH
    assert sum(e.token_id is not None for e in healthy_events) == 8


def test_min_new_tokens_equals_transformers_generate(engine, renderer) -> None:
    """min_tokens masks EOS as transformers' MinNewTokensLengthLogitsProcessor does: the same greedy tokens, past
    the EOS the capital answer ends with at token 8, and the EOS that ends it after the minimum."""
    import torch
    from transformers import AutoModelForCausalLM

    from handler.config import DEFAULT_MODEL_DIR

    prompt = chat_ids(renderer, PROMPTS[0])
    plain = collect(engine.submit(greedy("plain", prompt, max_new_tokens=20)))[0]
    assert plain.finish.finish_reason is FinishReason.EOS and len(plain.token_ids) == 8
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=12, do_sample=False)
    held = collect(engine.submit(greedy("held", prompt, max_new_tokens=20, min_new_tokens=12)))[0]
    assert held.token_ids == expected[0, len(prompt):].tolist()
    assert len(held.token_ids) >= 12 and held.token_ids[:7] == plain.token_ids[:7]


def _hf_beams(prompt: tuple[int, ...], width: int, n: int, max_new_tokens: int, **options) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from handler.config import DEFAULT_MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n, do_sample=False,
                         max_new_tokens=max_new_tokens, **options)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    rows = []
    for row in out[:, len(prompt):].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


@pytest.mark.parametrize(("width", "n", "options"), [
    (4, 2, {}),
    (3, 3, {"length_penalty": 0.0, "early_stopping": True}),
])
def test_beam_search_equals_transformers_generate(engine, renderer, width: int, n: int, options: dict) -> None:
    """Beams share the prompt's prefill, fork on divergence, and batch beside other requests: the same n best
    hypotheses as transformers' generate(num_beams=...), alone and with greedy neighbours in the step."""
    from handler.engine.types import BeamParams

    prompt = chat_ids(renderer, PROMPTS[1])
    beam = BeamParams(width, options.get("length_penalty", 1.0), options.get("early_stopping", False))
    request = GenerationRequest("beams", prompt, stop=StopConditions(max_new_tokens=24), n=n, beam=beam)
    expected = _hf_beams(prompt, width, n, 24, **options)
    alone = collect(engine.submit(request))
    assert [alone[i].token_ids for i in range(n)] == expected
    assert all(alone[i].finish.num_generated_tokens == len(expected[i]) for i in range(n))
    neighbours = [engine.submit(greedy(f"g{i}", chat_ids(renderer, p), max_new_tokens=30))
                  for i, p in enumerate(PROMPTS[2:5])]
    together = collect(engine.submit(request))
    assert [together[i].token_ids for i in range(n)] == expected
    assert all(collect(h)[0].finish is not None for h in neighbours)
    assert len({tuple(t) for t in expected}) == n  # distinct beams: the forks really diverged



def fail_once(monkeypatch, owner, name: str, error: Exception) -> None:
    """``owner.name`` raises ``error`` at its first call, then behaves as before."""
    real = getattr(owner, name)
    failures = iter([error])

    def once(*args, **kwargs):
        pending = next(failures, None)
        if pending is not None:
            raise pending
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, once)


def test_a_request_the_scheduler_cannot_take_fails_alone(engine, renderer, monkeypatch) -> None:
    fail_once(monkeypatch, engine._loop.scheduler, "add", RuntimeError("bad item"))
    failed = collect(engine.submit(greedy("bad", chat_ids(renderer, PROMPTS[0]))))[0]
    assert failed.finish is not None and failed.finish.finish_reason is FinishReason.ERROR
    assert "bad item" in failed.finish.error
    served = collect(engine.submit(greedy("next", chat_ids(renderer, PROMPTS[0]))))[0]
    assert served.finish is not None and served.finish.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)


def test_an_error_outside_a_model_step_ends_the_requests_in_flight_and_the_engine_goes_on(engine, renderer,
                                                                                          monkeypatch) -> None:
    """The engine thread's own bookkeeping raising (here: the scheduler, once) ends what is in flight with an error
    event, is counted as a restart of the engine loop, and the next request is served."""
    from handler import threads

    fail_once(monkeypatch, engine._loop.scheduler, "schedule", RuntimeError("lost track"))
    before = threads.restarts().get("engine", 0)
    failed = collect(engine.submit(greedy("bad", chat_ids(renderer, PROMPTS[0]))))[0]
    assert failed.finish is not None and failed.finish.finish_reason is FinishReason.ERROR
    assert "lost track" in failed.finish.error
    assert threads.restarts()["engine"] == before + 1
    served = collect(engine.submit(greedy("next", chat_ids(renderer, PROMPTS[0]))))[0]
    assert served.finish is not None and served.finish.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
    assert engine.is_ready
