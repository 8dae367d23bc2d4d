"""Embeddings: OpenAI's ``POST /v1/embeddings``, and the Databricks reference's ``input`` body on ``/invocations``.

Parsed as ``protocol.embeddings.EmbeddingRequestBody`` and prepared by it (texts tokenised), embedded by the backend
(``embed``: one forward on the engine's thread, pooled), answered once as OpenAI's list object
(``formatting.embeddings``), never streamed. Errors in OpenAI's shape.
"""

from __future__ import annotations

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, arrival, json_response
from handler.errors import BadRequest
from handler.formatting.embeddings import embedding_list
from handler.protocol.embeddings import EmbeddingRequestBody


class Embeddings(Endpoint):
    schema = "embeddings"

    @answers
    def post(self, call: Call) -> Response:
        return self.serve(call, call.json(), "json")

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        """Embeddings answer once: ``framing`` is the route's, and unused."""
        parsed, _extras = self.parse(call, EmbeddingRequestBody, body)
        self.note(call, False, body.get("input"))
        embedding = parsed.prepare(self.renderer(), call.record.request_id, arrival())
        result = self.service.engine.embed(embedding).result()
        size = len(result.vectors[0])
        if parsed.dimensions is not None and parsed.dimensions != size:
            raise BadRequest(f"this model's embeddings have {size} dimensions; it does not cut them to "
                             f"{parsed.dimensions}", param="dimensions")
        call.record.num_prompt_tokens = result.num_tokens
        return json_response(embedding_list(result, parsed.model or self.service.model_name, parsed.encoding_format))
