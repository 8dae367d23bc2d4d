"""One choice as a vLLM request, and vLLM's outputs as our events: the vLLM backend's translation layer.

Each choice of a ``GenerationRequest`` is its own vLLM request (``sampling_kwargs``: its seed is seed + index, as on
the lean engine), given token ids (``prompt_inputs``), streamed back as deltas. Our ``Sequence`` accepts every token
vLLM sampled (EOS, stop ids, stop strings held back across tokens, special tokens, max_new_tokens), so a choice ends
where the lean engine would end it; vLLM's own end (the context full, an abort) is passed on. Logprobs and prompt
logprobs come from vLLM's per-position dicts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable

from handler.engine.backend import EngineLimits
from handler.engine.core.request import RequestState, Sequence, Vocabulary
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest, PromptLogprob, TokenEvent, TopLogprob
from handler.engine.vllm.args import grammar_source, prompt_inputs, sampling_kwargs
from handler.errors import BadRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class VllmRequestState(RequestState):
    """A request on vLLM. It waits until it is among the first ``max_running`` choices in flight, in arrival order:
    vLLM's scheduler admits requests first come, first served up to ``max_num_seqs``, so those hold batch slots
    (prefilling or decoding) and the rest wait in its queue. (The first token is a later sign: a long prefill would
    count as waiting.)"""

    has_slot: bool = False

    @property
    def is_waiting(self) -> bool:
        return not self.has_slot and not self.is_expired and not self.cancelled.is_set()


def check_grammar(request: GenerationRequest) -> None:
    """A grammar llguidance refuses is a 400 at submit, as on the lean engine (vLLM would fail it later)."""
    import llguidance

    spec = request.grammar
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_source(spec), None)
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise BadRequest(f"{spec.param} cannot be compiled: {error}", param=spec.param)


class ChoiceRunner:
    """Runs choices on vLLM's engine (on the backend's loop) and turns their outputs into events; counts the tokens
    it accepted for the backend's stats."""

    def __init__(self, engine, vocab: Vocabulary, limits: EngineLimits,
                 forget: Callable[[RequestState], None]) -> None:
        self._engine = engine            # vllm.v1.engine.async_llm.AsyncLLM
        self._vocab, self.limits = vocab, limits
        self._forget = forget            # the backend's: a request whose choices have all ended leaves its slots
        self._ids = itertools.count()
        self.num_sampled = 0

    async def run(self, state: RequestState, index: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        request = state.request
        kwargs = sampling_kwargs(request, index, self.limits.max_model_len, self._vocab.eos_token_ids)
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        outputs = self._engine.generate(TokensPrompt(**prompt_inputs(request)), params,
                                        f"{request.request_id}-{index}-{next(self._ids)}",
                                        lora_request=state.adapter,  # a LoRARequest, or None: the base model
                                        priority=request.priority or 0)
        sequence = None
        try:
            async for output in outputs:
                if sequence is None:  # vLLM scheduled and prefilled it: it no longer waits
                    sequence = state.new_sequence(index)
                if self.accept(sequence, output):
                    return
        except asyncio.CancelledError:  # cancelled, overdue or stopping: whoever cancelled sends the final event
            raise
        except Exception as error:  # this choice fails; the engine and other requests go on
            log.exception("vLLM request %s failed", request.request_id)
            if sequence is None:
                sequence = state.new_sequence(index)
            self.finish(sequence, FinishReason.ERROR, error=f"model step failed: {type(error).__name__}: {error}")
        finally:
            await outputs.aclose()  # a choice that ended here (stop string) is aborted in vLLM
            self._forget(state)

    def accept(self, sequence: Sequence, output) -> bool:
        """Feed one vLLM output's new tokens to the sequence and send their events; True when the choice ended."""
        completion = output.outputs[0]
        first = not sequence.output_ids
        for position, token_id in enumerate(completion.token_ids):
            logprob, top = _logprobs(completion.logprobs, position, token_id, sequence.request.request.num_top_logprobs)
            accepted = sequence.accept(token_id, logprob, top)
            self.num_sampled += 1
            event = accepted.event
            if first and output.prompt_logprobs is not None:
                event = dataclasses.replace(event, prompt_logprobs=_prompt_logprobs(
                    output.prompt_token_ids, output.prompt_logprobs, sequence.request.request.prompt_logprobs or 0,
                    self._vocab.special_token_ids))
            first = False
            if accepted.finish_reason is not None:
                self.finish(sequence, accepted.finish_reason, event=event, error=accepted.error)
                return True
            sequence.request.events.put(event)
        if completion.finish_reason is None:
            return False
        # vLLM ended it where our checks did not: the context is full, or it aborted / failed the request
        reason = {"length": FinishReason.LENGTH, "abort": FinishReason.ABORT}.get(completion.finish_reason)
        tail = TokenEvent(index=sequence.index, token_id=None, text=sequence.detokenizer.flush())
        error = None if reason else f"vLLM ended the request: {completion.finish_reason}"
        self.finish(sequence, reason or FinishReason.ERROR, event=tail, error=error)
        return True

    def finish(self, sequence: Sequence, reason: FinishReason, *, event: TokenEvent | None = None,
               error: str | None = None, error_kind: ErrorKind = ErrorKind.MODEL) -> None:
        """End a choice: its last event carries the reason (and the error, if any) and the usage counts."""
        sequence.finish_reason = reason
        base = event or TokenEvent(index=sequence.index, token_id=None, text="")
        sequence.request.events.put(dataclasses.replace(
            base, finish_reason=reason, error=error, error_kind=error_kind if error else None,
            num_prompt_tokens=sequence.num_prompt_tokens, num_generated_tokens=len(sequence.output_ids)))


def _logprobs(positions, position: int, token_id: int, num_top: int) -> tuple[float, tuple[TopLogprob, ...]]:
    """The chosen token's logprob and the ``num_top`` most likely tokens from vLLM's per-position dicts
    (``{token_id: Logprob(logprob, rank, ...)}``: the chosen token and the top ones, ranks from 1)."""
    if not positions or position >= len(positions) or positions[position] is None:
        return 0.0, ()
    entries = positions[position]
    chosen = entries[token_id].logprob if token_id in entries else 0.0
    if num_top <= 0:
        return chosen, ()
    top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None and e.rank <= num_top)
    return chosen, tuple(TopLogprob(t, lp) for _rank, t, lp in top)


def _prompt_logprobs(prompt_ids, positions, num_top: int, special_ids) -> tuple[PromptLogprob, ...]:
    """vLLM's prompt logprobs (None first, then per prompt token a dict of it and the ``num_top`` most likely) as
    ``PromptLogprob``s."""
    result = []
    for token_id, entries in zip(prompt_ids, positions, strict=True):
        is_special = token_id in special_ids
        if not entries:
            result.append(PromptLogprob(token_id, None, is_special=is_special))
            continue
        own = entries[token_id]
        top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None and e.rank <= num_top)
        result.append(PromptLogprob(token_id, own.logprob, own.rank, tuple(TopLogprob(t, lp) for _r, t, lp in top),
                                    is_special))
    return tuple(result)
