"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize``, answered with the tokenizer alone on the
request's thread (``protocol.tokenize``): they never wait for, or take time from, the engine. Errors in OpenAI's
shape."""

from __future__ import annotations

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, json_response
from handler.protocol import tokenize


class Tokenizer(Endpoint):
    @answers
    def tokenize(self, call: Call) -> Response:
        body = call.json()
        return json_response(tokenize.tokenize(body, self.renderer(), self.service.engine.limits.max_model_len))

    @answers
    def detokenize(self, call: Call) -> Response:
        body = call.json()
        return json_response(tokenize.detokenize(body, self.renderer()))
