"""From a validated request to engine requests: the prompt layer renders, the protocol model converts.

Each schema's parsed request is checked across its fields, its prompts rendered by the model's ``PromptRenderer``
(tokenizer, chat template, tool-call dialect; for a vision model its images are fetched, decoded and run through
the vision tower here, on the request's thread), then converted into ``GenerationRequest``s. This module is where
the two meet, so the work a request costs before it reaches the engine is visible in one place.

Each request is stamped with the time it got here (``arrived_at``): its ``option.request_timeout`` counts from then,
so the time spent rendering, fetching and encoding images is part of it.
"""

from __future__ import annotations

import dataclasses
import time

from handler.engine.types import EmbeddingRequest, GenerationRequest
from handler.errors import BadRequest, ServingError, Unprocessable
from handler.prompt.renderer import PromptRenderer
from handler.protocol.chat import ChatCompletionRequest
from handler.protocol.completions import CompletionRequest, check_token_ids
from handler.protocol.embeddings import EmbeddingRequestBody
from handler.protocol.legacy import LegacyRequest
from handler.protocol.responses import ResponsesRequest, new_response_id, responses_error, responses_param
from handler.protocol.structured import OutputPlan


def chat_request(parsed: ChatCompletionRequest, renderer: PromptRenderer,
                 default_temperature: float) -> GenerationRequest:
    arrived_at = time.monotonic()
    parsed.check()
    plan = parsed.output_plan(renderer)
    messages, images = parsed.prompt_messages()
    prompt = renderer.render_prompt(messages, tools=list(plan.tools), images=images, arrived_at=arrived_at,
                                    template_kwargs=parsed.template_kwargs())
    generation = parsed.to_generation_request(prompt, plan, default_temperature)
    return dataclasses.replace(_with_reasoning(generation, renderer, plan), arrived_at=arrived_at)


def _with_reasoning(generation: GenerationRequest, renderer: PromptRenderer, plan: OutputPlan) -> GenerationRequest:
    """For a reasoning model: its markers' special tokens kept in the text (the formatter splits on them), and
    an output grammar that starts once the reasoning has ended (unless it spans the reasoning itself: gpt-oss's
    forced calls)."""
    if renderer.reasoning_parser is None:
        return generation
    grammar, gate = generation.grammar, renderer.reasoning_gate(generation.prompt_ids)
    if grammar is not None and gate is not None and not plan.spans_reasoning:
        grammar = dataclasses.replace(grammar, after_reasoning=gate)
    keep = generation.keep_special_ids + renderer.reasoning_keep_ids
    return dataclasses.replace(generation, grammar=grammar, keep_special_ids=keep)


def responses_request(parsed: ResponsesRequest, history: list[dict], renderer: PromptRenderer,
                      default_temperature: float) -> tuple[GenerationRequest, OutputPlan, list[str]]:
    """A Responses request as the chat request it converts into (``history``: the stored conversation it
    continues, then its own input), rendered and converted as chat is; errors name the Responses fields. Also the
    output plan (tool format) and which field each message came from, for errors the engine raises later."""
    parsed.check()
    chat, fields = parsed.to_chat(history)
    try:
        generation = chat_request(chat, renderer, default_temperature)
    except ServingError as error:
        raise responses_error(error, fields) from None
    grammar = generation.grammar
    if grammar is not None:
        grammar = dataclasses.replace(grammar, param=responses_param(grammar.param, fields) or grammar.param)
    generation = dataclasses.replace(generation, request_id=new_response_id(), prompt_param="input", grammar=grammar)
    return generation, chat.output_plan(renderer), fields


def legacy_requests(parsed: LegacyRequest, renderer: PromptRenderer,
                    default_max_new_tokens: int) -> list[GenerationRequest]:
    """Each input tokenised as it is, with the tokenizer's own special tokens (TGI, LMI)."""
    arrived_at = time.monotonic()
    parsed.check()
    prompt_ids = [renderer.encode(prompt, add_special_tokens=True) for prompt in parsed.prompts]
    return _arrived(parsed.to_generation_requests(prompt_ids, default_max_new_tokens), arrived_at)


def completion_requests(parsed: CompletionRequest, renderer: PromptRenderer,
                        default_temperature: float) -> list[GenerationRequest]:
    """``use_raw_prompt`` absent or true: each prompt tokenised as it is; false (Databricks): sent as one user
    message through the chat template. A token prompt goes as it is."""
    arrived_at = time.monotonic()
    parsed.check()
    prompt_ids = [_completion_prompt(parsed, renderer, prompt, index) for index, prompt in enumerate(parsed.prompts)]
    return _arrived(parsed.to_generation_requests(prompt_ids, default_temperature), arrived_at)


def embedding_request(parsed: EmbeddingRequestBody, renderer: PromptRenderer, request_id: str) -> EmbeddingRequest:
    """Each text input tokenised with the tokenizer's own special tokens (as sentence-transformers encodes it);
    token-id inputs go as they are."""
    arrived_at = time.monotonic()
    if parsed.instruction is not None and parsed.texts() is None:
        raise BadRequest("instruction is put before text inputs; these are token ids", param="instruction")
    texts = parsed.texts()
    if texts is None:
        inputs = parsed.token_inputs()
        for index, ids in enumerate(inputs):
            check_token_ids(ids, renderer.vocab_size, "input" if len(inputs) == 1 else f"input[{index}]")
    else:
        inputs = [renderer.encode(text, add_special_tokens=True) for text in texts]
    return EmbeddingRequest(request_id, tuple(tuple(ids) for ids in inputs), arrived_at)


def _arrived(generations: list[GenerationRequest], arrived_at: float) -> list[GenerationRequest]:
    return [dataclasses.replace(generation, arrived_at=arrived_at) for generation in generations]


def echo_texts(parsed: CompletionRequest, renderer: PromptRenderer) -> tuple[str, ...]:
    """What echo prepends to each prompt's completions: the text as sent, a token prompt's decoded text (vLLM)."""
    if not parsed.echo:
        return ()
    return tuple(prompt if isinstance(prompt, str) else renderer.decode(prompt) for prompt in parsed.prompts)


def _completion_prompt(parsed: CompletionRequest, renderer: PromptRenderer, prompt: str | list[int],
                       index: int) -> list[int]:
    if isinstance(prompt, list):
        if parsed.use_raw_prompt is False:
            raise BadRequest("use_raw_prompt: false sends a text prompt through the chat template; a token prompt "
                             "goes to the model as it is", param="use_raw_prompt")
        check_token_ids(prompt, renderer.vocab_size, parsed.prompt_param(index))
        return list(prompt)
    if parsed.use_raw_prompt is not False:
        return renderer.encode(prompt, add_special_tokens=True)
    if not renderer.has_chat_template:
        raise Unprocessable("use_raw_prompt: false needs a chat template, and this model has none",
                            param="use_raw_prompt")
    return renderer.render_chat([{"role": "user", "content": prompt}])
