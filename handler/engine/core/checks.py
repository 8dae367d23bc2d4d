"""The refusals every backend makes when a request is submitted, before it queues, with the same messages: a prompt
that is empty or too long for the context, more choices or beams than the batch runs at once, token ids outside the
vocabulary; and the one change a request may ask of its prompt (``truncate_prompt``: drop its oldest tokens)."""

from __future__ import annotations

import dataclasses

from handler.engine.backend import EngineLimits
from handler.engine.types import GenerationRequest
from handler.errors import BadRequest


def fit_prompt(request: GenerationRequest, limits: EngineLimits) -> GenerationRequest:
    """With ``truncate_prompt``, drop the prompt's oldest tokens so that it and max_new_tokens (at least one token)
    fit the context (Databricks' ``error_behavior: truncate``)."""
    limit = limits.max_model_len
    reserve = min(request.stop.max_new_tokens or 1, limit - 1)
    if not request.truncate_prompt or len(request.prompt_ids) <= limit - reserve:
        return request
    if request.prompt_embeds is not None or request.prompt_images is not None:
        raise BadRequest("a prompt with images cannot be truncated to fit the context; send fewer or smaller "
                         "images", param=request.prompt_param)
    return dataclasses.replace(request, prompt_ids=request.prompt_ids[len(request.prompt_ids) - (limit - reserve):])


def check_request(request: GenerationRequest, limits: EngineLimits, vocab_size: int | None) -> None:
    """Raise ``BadRequest`` naming the field for a request no batch of this server could run (``vocab_size``: None
    while the model is loading, when token ids are not checked)."""
    num_prompt = len(request.prompt_ids)
    beam = request.beam
    if beam is not None and beam.width > limits.max_running:
        raise BadRequest(f"beam search with {beam.width} beams needs {beam.width} sequences at once; this server "
                         f"runs {limits.max_running} (option.max_rolling_batch_size)", param=beam.param)
    if num_prompt == 0:
        raise BadRequest("the prompt is empty after tokenisation", param=request.prompt_param)
    if num_prompt >= limits.max_model_len:
        raise BadRequest(f"the prompt has {num_prompt} tokens; this model's context is {limits.max_model_len} "
                         "tokens (option.max_model_len), prompt and completion together", param=request.prompt_param)
    if request.n > limits.max_running:
        raise BadRequest(f"{request.n} choices (n, or best_of when given) are more than the {limits.max_running} "
                         "sequences this server runs at once (option.max_rolling_batch_size)", param="n")
    if vocab_size is None:
        return
    if not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocab_size:  # token prompts
        raise BadRequest(f"the prompt has a token id outside the vocabulary (0..{vocab_size - 1})",
                         param=request.prompt_param)
    for token_id, _bias in request.sampling.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise BadRequest(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                             param="logit_bias")
