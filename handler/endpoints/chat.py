"""OpenAI's chat completions: ``POST /v1/chat/completions``, and a body with ``messages`` on ``/invocations``.

Parsed as ``protocol.chat.ChatCompletionRequest``, prepared by it (checked, rendered by the model's chat template
with tools and images, converted), submitted as one engine request with ``n`` choices, and answered as one
``chat.completion`` or ``chat.completion.chunk`` records (``formatting.chat``), as server-sent events on
``/v1/chat/completions`` and in ``/invocations``' framing there. Errors in OpenAI's shape.
"""

from __future__ import annotations

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, arrival, json_response, stream_response
from handler.formatting.chat import ChatContext, chat_chunks, chat_completion
from handler.protocol.chat import ChatCompletionRequest


class Chat(Endpoint):
    schema = "chat"

    @answers
    def post(self, call: Call) -> Response:
        return self.serve(call, call.json(), "sse")

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        parsed, extras = self.parse(call, ChatCompletionRequest, body)
        self.note(call, parsed.stream, body.get("messages"))
        renderer = self.renderer(generates="messages")
        prepared = parsed.prepare(renderer, self.service.defaults.temperature, arrival())
        generation = self.with_adapter(call, [extras.apply(prepared.generation)], parsed.model)[0]
        handle = self.submit(call, generation)
        ctx = self.context(ChatContext, generation.request_id, parsed.model, want_logprobs=parsed.logprobs,
                           include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                           keep_best=parsed.n if parsed.best_of and generation.beam is None else None,
                           tool_format=prepared.plan.tool_format, tool_calls_only=prepared.plan.calls_only,
                           reasoning_parser=prepared.reasoning_parser, reasoning_opened=prepared.reasoning_opened)
        if not parsed.stream:
            try:
                return json_response(chat_completion(handle, generation.n, ctx))
            finally:
                handle.cancel()  # when one choice failed, the others stop too
        return stream_response(chat_chunks(handle, generation.n, ctx), framing, [handle], self.stream_error)
