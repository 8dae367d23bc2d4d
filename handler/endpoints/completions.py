"""OpenAI's completions: ``POST /v1/completions``, and a body with ``prompt`` on ``/invocations``.

Parsed as ``protocol.completions.CompletionRequest`` and prepared by it (each prompt tokenised, or sent through the
chat template with ``use_raw_prompt: false``); one engine request per prompt, each with its choices, answered as one
``text_completion`` object or its chunks (``formatting.completions``). Errors in OpenAI's shape.
"""

from __future__ import annotations

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, arrival, json_response, stream_response
from handler.formatting.completions import CompletionsContext, completion, completion_chunks
from handler.protocol.completions import CompletionRequest


class Completions(Endpoint):
    schema = "completions"

    @answers
    def post(self, call: Call) -> Response:
        return self.serve(call, call.json(), "sse")

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        parsed, extras = self.parse(call, CompletionRequest, body)
        self.note(call, parsed.stream, body.get("prompt"))
        renderer = self.renderer(generates="prompt")
        generations = [extras.apply(generation) for generation in
                       parsed.prepare(renderer, self.service.defaults.temperature, arrival())]
        generations = self.with_adapter(call, generations, parsed.model)
        echoed = parsed.echo_texts(renderer)
        handles = self.submit_all(call, generations)
        first = generations[0]
        ctx = self.context(CompletionsContext, first.request_id, parsed.model,
                           want_logprobs=parsed.logprobs is not None, num_logprobs=parsed.logprobs or 0,
                           include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                           prompt_texts=echoed, return_full_text=parsed.echo,
                           is_echo_only=parsed.is_echo_only, num_prompt_logprobs=parsed.prompt_logprobs,
                           keep_best=parsed.n if parsed.best_of and first.beam is None else None,
                           suffix=parsed.suffix or "")
        if parsed.stream:
            return stream_response(completion_chunks(handles[0], first.n, ctx), framing, handles, self.stream_error)
        try:
            return json_response(completion(handles, first.n, ctx))
        finally:
            for handle in handles:  # when one prompt failed, the others stop too
                handle.cancel()
