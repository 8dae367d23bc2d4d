"""Beam search on the vLLM backend: the lean engine's search (``core.beam``) over vLLM's next-token logprobs.

vLLM's engine has no beam search of its own (its HTTP server drives one from outside, a token at a time); this does
the same with our search rule, so both backends pick the same beams. Each step asks vLLM, for every beam at once,
one token with the top ``k`` logprobs (``max_tokens=1``), the prompt being the request's prompt and the beam's tokens
so far; vLLM's prefix cache keeps each beam's history, so a step recomputes only the last block. The ``k`` logprobs
of each beam (the candidates the rule ranks, plus the ending ids a ``min_new_tokens`` mask would take away) go into
a ``[width, vocab]`` tensor of -inf, which ``BeamSearch.step`` takes as the lean engine's rows. The logprobs are
vLLM's processed ones (``processed_logprobs``: after ``logit_bias`` and ``repetition_penalty``, which see the beam's
tokens in the prompt, as the lean engine's penalty sees prompt and output); the ending ids are masked here after the
softmax while ``min_new_tokens`` holds them, as the lean engine masks them. ``frequency_penalty`` and
``presence_penalty`` count output tokens only, which a one-token request has none of: refused with beams at submit.
When the search is done, its ``n`` best hypotheses go out as choices (``core.beam.send_hypotheses``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import torch

from handler.engine.backend import EngineLimits
from handler.engine.core.beam import BeamSearch, GroupBeamSearch, new_search, send_hypotheses
from handler.engine.core.request import RequestState, Vocabulary
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest
from handler.engine.vllm.args import max_new_tokens, prompt_inputs
from handler.errors import Unprocessable

log = logging.getLogger(__name__)


def candidates_per_beam(request: GenerationRequest, eos_token_ids) -> int:
    """The logprobs each beam needs from vLLM: the rule's ``k`` candidates, and besides them the tokens the rule may
    push below them: the ending ids when ``min_new_tokens`` masks them, and in diverse beam search the tokens the
    earlier groups chose this step (one a beam), which the penalty lowers."""
    search = new_search(request, eos_token_ids, 1)
    extra = len(search.ending_ids) if request.stop.min_new_tokens else 0
    if request.beam.groups > 1:
        extra += request.beam.width - request.beam.width // request.beam.groups
    return search.num_candidates + extra


def check_beams(request: GenerationRequest, eos_token_ids, max_logprobs: int) -> None:
    """What this bridge cannot rank as the lean engine does, refused at submit naming the field."""
    beam, sampling = request.beam, request.sampling
    for name, value in (("frequency_penalty", sampling.frequency_penalty),
                        ("presence_penalty", sampling.presence_penalty)):
        if value:
            raise Unprocessable(f"beam search on the vLLM backend takes no {name} (vLLM counts it over a request's "
                                "output, and each beam step is a one-token request); repetition_penalty applies",
                                param=name)
    needed = candidates_per_beam(request, eos_token_ids)
    if needed > max_logprobs:
        raise Unprocessable(f"beam search with {beam.width} beams ranks {needed} candidates a beam; vLLM returns at "
                            f"most {max_logprobs} logprobs a token (its max_logprobs): use fewer beams",
                            param=beam.param)


class BeamRunner:
    """Runs beam requests on vLLM's engine (on the backend's loop)."""

    def __init__(self, engine, vocab: Vocabulary, vocab_size: int, limits: EngineLimits,
                 forget: Callable[[RequestState], None]) -> None:
        self._engine = engine            # vllm.v1.engine.async_llm.AsyncLLM
        self._vocab, self._vocab_size, self.limits = vocab, vocab_size, limits
        self._forget = forget            # the backend's: the request leaves its slots
        self._ids = itertools.count()
        self.num_sampled = 0

    async def run(self, state: RequestState) -> None:
        request = state.request
        search = new_search(request, self._vocab.eos_token_ids, max_new_tokens(request, self.limits.max_model_len))
        state.beams = search
        try:
            while not search.done:
                search.step(await self._logprobs(request, search, state.adapter))
                self.num_sampled += request.beam.width
        except asyncio.CancelledError:  # cancelled, overdue or stopping: whoever cancelled ends the request
            raise
        except Exception as error:  # this request fails; the engine and other requests go on
            log.exception("vLLM beam search %s failed", request.request_id)
            state.finish_unstarted(FinishReason.ERROR, f"beam search failed: {type(error).__name__}: {error}",
                                   ErrorKind.MODEL)
            return
        finally:
            self._forget(state)
        send_hypotheses(state, search.best(state.n), None, self._vocab, self.limits.max_model_len)

    def cut(self, state: RequestState) -> bool:
        """Past the deadline: the best beams so far go out as choices (``DEADLINE``); False when the search had not
        started (the caller ends the request with the timeout error)."""
        if state.beams is None or state.choices_ended:
            return False
        send_hypotheses(state, state.beams.best_so_far(state.n), FinishReason.DEADLINE, self._vocab,
                        self.limits.max_model_len)
        return True

    async def _logprobs(self, request: GenerationRequest, search: BeamSearch | GroupBeamSearch,
                        adapter: object | None) -> torch.Tensor:
        """The step's ``[width, vocab]`` rows: each beam's top logprobs, -inf elsewhere. At the first step every
        beam is the prompt: one request, its row copied. ``adapter``: the LoRARequest the request runs under."""
        width = request.beam.width
        slots = [0] if search.length == 0 else list(range(width))
        found = await asyncio.gather(*(self._top(request, search.tokens_of(slot) if search.length else [], adapter)
                                       for slot in slots))
        rows = torch.full((width, self._vocab_size), float("-inf"))
        for slot, entries in zip(slots, found, strict=True):
            ids, values = zip(*entries.items(), strict=True)
            rows[slot, list(ids)] = torch.tensor(values, dtype=torch.float32)
        if search.length == 0:
            rows[1:] = rows[0]
        if search.length < (request.stop.min_new_tokens or 0) and search.ending_ids:
            rows[:, sorted(search.ending_ids)] = float("-inf")
        return rows

    async def _top(self, request: GenerationRequest, tokens: list[int], adapter: object | None) -> dict[int, float]:
        """vLLM's top logprobs of the next token after the prompt and ``tokens``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling = request.sampling
        params = SamplingParams(n=1, max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                                logprobs=candidates_per_beam(request, self._vocab.eos_token_ids),
                                repetition_penalty=sampling.repetition_penalty,
                                logit_bias=dict(sampling.logit_bias) or None, output_kind=RequestOutputKind.FINAL_ONLY)
        inputs = prompt_inputs(request)
        inputs["prompt_token_ids"] = inputs["prompt_token_ids"] + tokens
        outputs = self._engine.generate(TokensPrompt(**inputs), params,
                                        f"{request.request_id}-beam-{next(self._ids)}", lora_request=adapter,
                                        priority=request.priority or 0)
        last = None
        try:
            async for output in outputs:
                last = output
        finally:
            await outputs.aclose()
        if last is None or not last.outputs[0].logprobs:
            raise RuntimeError("vLLM returned no logprobs for a beam step")
        return {token: entry.logprob for token, entry in last.outputs[0].logprobs[0].items()}
