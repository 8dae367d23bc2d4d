"""Per-request and per-choice state, as every backend keeps it, and the handle a caller reads events from.

A ``RequestState`` is one submitted ``GenerationRequest`` with everything a backend keeps for it (its deadline,
its compiled grammar, its event queue, whether it was cancelled, its prompt's logprobs); it owns ``n``
``Sequence``s (one per choice) once its prompt has been prefilled. A ``Sequence`` accepts its sampled tokens
itself: it advances its grammar, detokenises, and decides when its choice ends. A sequence is finished exactly
when its ``finish_reason`` is set.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from handler.engine.core.detokenizer import IncrementalDetokenizer
from handler.engine.core.sampler import RowState
from handler.engine.types import (
    ErrorKind,
    FinishReason,
    GenerationRequest,
    PromptLogprob,
    StopConditions,
    TokenEvent,
    TopLogprob,
)

_POLL_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What every choice needs of the model's tokenizer: the text of tokens, which ids end a choice, which are
    special."""

    tokenizer: object                  # tokenizers.Tokenizer
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class Accepted:
    """What a sequence made of one sampled token: the event to send, and the finish reason if the token ended it."""

    event: TokenEvent | None               # None: the grammar refused the token
    finish_reason: FinishReason | None = None
    error: str | None = None               # set with FinishReason.ERROR


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of one request: its tokens, its cache slot and how far its tokens are cached.

    A sequence prefills up to ``prefill_target``: its prompt, or after it was preempted (its slot taken back for
    memory) its prompt and every token it had generated, recomputed; the logits of that prefill's last position are
    those the next decode step would have given, so it goes on sampling as if never interrupted."""

    request: RequestState
    index: int
    row: RowState
    detokenizer: IncrementalDetokenizer
    max_new_tokens: int
    kv_slot: object = None           # its place in the runner's KV memory (the KV space's handle; None: not running)
    num_cached: int = 0
    num_cached_prefix: int = 0       # leading tokens whose KV was copied in (prefix cache), not computed
    prefix_kv: object = None         # what to copy in: the runner's, set when the sequence is admitted
    resuming: bool = False           # recomputing its prompt and output after a preemption
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its whole blocks, as known
    num_stored_blocks: int = 0       # leading blocks already offered to the prefix cache
    finish_reason: FinishReason | None = None
    vocab: Vocabulary | None = None  # set by ``create``; only sequences that accept tokens need it

    @classmethod
    def create(cls, state: RequestState, index: int, vocab: Vocabulary, max_model_len: int) -> Sequence:
        """Choice ``index`` of ``state``: its own sampling row, grammar copy and detokenizer."""
        request = state.request
        room = max_model_len - state.num_prompt_tokens
        wanted = request.stop.max_new_tokens
        matcher = state.matcher.deep_copy() if state.matcher is not None else None
        stop = request.stop
        held = () if stop.min_new_tokens == 0 else tuple(sorted(
            set(stop.stop_token_ids) | (set() if stop.ignore_eos else set(vocab.eos_token_ids))))
        row = RowState(request.sampling, list(request.prompt_ids), [], make_generator(request.sampling.seed, index),
                       request.num_top_logprobs, matcher, min_new_tokens=stop.min_new_tokens, ending_ids=held)
        detokenizer = IncrementalDetokenizer(vocab.tokenizer, stop.stop_strings,
                                             include_stop=stop.include_stop_str_in_output, options=request.text,
                                             special_ids=vocab.special_token_ids, keep_ids=request.keep_special_ids)
        return cls(state, index, row, detokenizer, max_new_tokens=room if wanted is None else min(wanted, room),
                   vocab=vocab)

    @property
    def stop(self) -> StopConditions:
        return self.request.request.stop

    @property
    def prompt_ids(self) -> list[int]:
        return self.row.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.row.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.row.prompt_ids)

    @property
    def prefill_target(self) -> int:
        return self.num_tokens if self.resuming else self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill scores the prompt (the request asked; a sequence resumed with output has them already)."""
        return self.request.request.prompt_logprobs is not None and not self.output_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def order(self) -> tuple[int, int]:
        """Older requests first, then lower choice indexes: the reverse of preemption's order."""
        return self.request.order, self.index

    def token_at(self, position: int) -> int:
        prompt = self.row.prompt_ids
        return prompt[position] if position < len(prompt) else self.row.output_ids[position - len(prompt)]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end-1`` of the prompt followed by the output."""
        prompt = self.row.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.row.output_ids)[start:end]

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.row.output_ids)

    @property
    def is_beam(self) -> bool:
        return self.request.request.beam is not None

    @property
    def reserve(self) -> int:
        """Positions its slot takes when placed: what it prefills and the next; a beam, all it can ever hold (a
        beam never grows, so it is never preempted and every beam of a request steps together)."""
        return self.num_prompt_tokens + self.max_new_tokens if self.is_beam else self.prefill_target + 1

    @property
    def next_token(self) -> int:
        """The token whose KV the next decode step computes (a placeholder while prefilling)."""
        return self.output_ids[-1] if not self.is_prefilling else self.token_at(self.num_cached)

    def preempted(self) -> None:
        """Its slot was taken back: it computes everything again when it resumes (``resume``)."""
        self.kv_slot, self.num_cached, self.num_cached_prefix, self.prefix_kv = None, 0, 0, None
        self.num_stored_blocks = 0

    def resume(self) -> None:
        """Readmitted after a preemption: prefill its prompt and whatever it had generated (a token sampled in
        the step that preempted it included)."""
        self.resuming = bool(self.output_ids)

    def accept(self, token_id: int, logprob: float, top_logprobs: tuple[TopLogprob, ...]) -> Accepted:
        """Append a sampled token, advance the grammar, and release the token's text; say whether the choice ends."""
        self.output_ids.append(token_id)
        is_eos = token_id in self.vocab.eos_token_ids and not self.stop.ignore_eos
        matcher = self.row.matcher
        if matcher is not None and not matcher.consume_token(token_id):
            return Accepted(None, FinishReason.ERROR, f"the output grammar refused token {token_id}")
        text, hit_stop_string = self._text(token_id, is_eos or token_id in self.stop.stop_token_ids)
        # a grammar that is complete allows only EOS next: end the choice as if the model had sent it
        is_complete = is_eos or (matcher is not None and matcher.is_stopped())
        reason = self._finish_reason(token_id, is_complete, hit_stop_string)
        if reason is not None and reason is not FinishReason.STOP:
            text += self.detokenizer.flush()
        prompt = self.request.prompt_logprob_entries() if len(self.output_ids) == 1 else ()  # the first event's
        event = TokenEvent(index=self.index, token_id=token_id, text=text, logprob=logprob,
                           top_logprobs=top_logprobs, is_special=token_id in self.vocab.special_token_ids,
                           prompt_logprobs=prompt)
        return Accepted(event, reason)

    def _text(self, token_id: int, is_ending_token: bool) -> tuple[str, bool]:
        """The text a token releases, and whether a stop string completed. The EOS or stop token that ends the
        choice has text only with ``include_stop_str_in_output`` (vLLM's rule); stop strings count from the
        ``min_new_tokens``-th token on."""
        if is_ending_token and not self.stop.include_stop_str_in_output:
            return "", False
        return self.detokenizer.push(token_id, stops_count=len(self.output_ids) >= self.stop.min_new_tokens)

    def _finish_reason(self, token_id: int, is_end: bool, hit_stop: bool) -> FinishReason | None:
        if is_end:
            return FinishReason.EOS
        if hit_stop or token_id in self.stop.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_ids) >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None


@dataclass(slots=True, eq=False)
class RequestState:
    """A submitted request, shared by the engine thread and the thread that reads its events. It waits until its
    first sequence takes a slot."""

    request: GenerationRequest
    make_sequence: Callable[[RequestState, int], Sequence]
    deadline: float = math.inf         # time.monotonic() value
    matcher: object | None = None      # the request's compiled grammar, unadvanced; each choice advances a copy
    adapter: object | None = None      # model.lora.AdapterWeights the request generates with (None: the base model)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sequences: list[Sequence] = field(default_factory=list)
    is_expired: bool = False
    prompt_logprobs: dict[int, PromptLogprob] = field(default_factory=dict)  # by prompt position, as prefill scores
    order: int = 0                     # the scheduler's arrival number
    # steps in which newer work was admitted or prefilled while this request got nothing (the scheduler's bound on
    # how long a better priority can pass it)
    passed: int = 0
    queued_at: float = field(default_factory=time.monotonic)  # the backend's intake: its queue time counts from here
    beams: object | None = None        # core.beam.BeamSearch, once a beam request's beams have forked
    choices_ended: bool = False        # a beam request sent its choices' final events (its beams are no choices)

    @property
    def n(self) -> int:
        """The choices the caller gets."""
        return self.request.n

    @property
    def num_sequences(self) -> int:
        """The sequences the request runs: its choices, or its beams."""
        return self.request.beam.width if self.request.beam is not None else self.request.n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def priority(self) -> int:
        """Lower is admitted and prefilled first (``GenerationRequest.priority``; not asked: 0)."""
        return self.request.priority or 0

    @property
    def is_waiting(self) -> bool:
        return not self.sequences and not self.is_expired and not self.cancelled.is_set()

    def prompt_logprob_entries(self) -> tuple[PromptLogprob, ...]:
        """What each choice's first event carries: one entry per prompt token, the first (no context) without a
        logprob; empty when the request did not ask (``prompt_logprobs`` scores them as prefill runs)."""
        if self.request.prompt_logprobs is None:
            return ()
        scored, prompt_ids = self.prompt_logprobs, self.request.prompt_ids
        return tuple(scored.get(p) or PromptLogprob(token_id, None) for p, token_id in enumerate(prompt_ids))

    def new_sequence(self, index: int) -> Sequence:
        sequence = self.make_sequence(self, index)
        self.sequences.append(sequence)
        return sequence

    def end_overdue(self, finish: Callable[..., None], message: str) -> None:
        """Past ``option.request_timeout``: a choice that has generated tokens ends with ``DEADLINE`` and its text so
        far (held text released, as when ``max_tokens`` cuts it), so the user gets the answer that was paid for in
        time; a choice with none, and any not started, ends with the timeout error (504). ``finish`` is the
        backend's ``(sequence, reason, *, event, error, error_kind)``."""
        self.is_expired = True
        for sequence in list(self.sequences):
            if sequence.finish_reason is not None:
                continue
            if sequence.output_ids:
                tail = TokenEvent(index=sequence.index, token_id=None, text=sequence.detokenizer.flush())
                finish(sequence, FinishReason.DEADLINE, event=tail)
            else:
                finish(sequence, FinishReason.ERROR, error=message, error_kind=ErrorKind.TIMEOUT)
        self.finish_unstarted(FinishReason.ERROR, message, ErrorKind.TIMEOUT)

    def finish_unstarted(self, reason: FinishReason, error: str | None = None,
                         error_kind: ErrorKind | None = None) -> None:
        """End the choices that have no sequence yet (the request never got a slot, or was not forked yet)."""
        if self.choices_ended:
            return
        started = {s.index for s in self.sequences} if self.request.beam is None else set()
        for index in range(self.n):
            if index not in started:
                self.events.put(TokenEvent(index=index, token_id=None, text="", finish_reason=reason, error=error,
                                           error_kind=error_kind, num_prompt_tokens=self.num_prompt_tokens))


class RequestHandle:
    """What ``Engine.submit`` returns: iterate it for ``TokenEvent``s; ``cancel()`` when the client is gone."""

    def __init__(self, state: RequestState, is_engine_alive: Callable[[], bool]) -> None:
        self._state = state
        self._is_engine_alive = is_engine_alive

    @property
    def request(self) -> GenerationRequest:
        return self._state.request

    def cancel(self) -> None:
        self._state.cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        remaining = self._state.n
        while remaining:
            event = self._next_event()
            if event is None:
                yield from self._engine_died(remaining)
                return
            yield event
            remaining -= event.finish_reason is not None

    def _next_event(self) -> TokenEvent | None:
        while True:
            try:
                return self._state.events.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self._is_engine_alive():
                    return None

    def _engine_died(self, remaining: int) -> Iterator[TokenEvent]:
        beams = self._state.request.beam is not None  # a beam request's sequences are its beams, not its choices
        finished = set() if beams else {s.index for s in self._state.sequences if s.finish_reason is not None}
        pending = [i for i in range(self._state.n) if i not in finished][:remaining]
        for index in pending:
            yield TokenEvent(index=index, token_id=None, text="", finish_reason=FinishReason.ERROR,
                             error="the generation engine stopped", error_kind=ErrorKind.STOPPED,
                             num_prompt_tokens=self._state.num_prompt_tokens)


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Choice ``index`` of a seeded request draws from seed + index, so choices differ but repeat exactly."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed + index) % (2**63))
