"""SageMaker's ``POST /invocations``: the body says which API it is, and that API's endpoint answers it.

``requestType`` means a stateful session's NEW_SESSION or CLOSE (the standards package's rule: whatever else the
body holds, which is then refused), else ``messages`` means chat completions (it wins when ``inputs`` is there too),
else ``inputs`` means the legacy schema, else ``prompt`` means completions, else ``input`` means a Responses request
or embeddings (``is_responses_body`` says which), else ``query`` with ``texts`` means TEI's rerank, ``query`` with
``documents`` the Cohere / Jina rerank, ``text_1`` with ``text_2`` vLLM's score, else 400 naming the fields. A
stream is framed as server-sent events when the client accepts ``text/event-stream``, else as
``option.output_formatter`` says (JSON lines by default).

The endpoints themselves come from ``server``'s route table (``apis``: schema -> the endpoint's ``serve``): this
module names the schemas, and imports no endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from flask import Response

from handler.endpoints.base import Call, Endpoint, FrontDoor, answers
from handler.errors import BadRequest
from handler.protocol.embeddings import EmbeddingRequestBody
from handler.protocol.responses import ResponsesRequest

# An endpoint's answer to a body on /invocations: (the call, the body, the framing asked for) -> the response.
Serve = Callable[[Call, dict, str], Response]


class Invocations(Endpoint):
    def __init__(self, door: FrontDoor, apis: Mapping[str, Serve]) -> None:
        super().__init__(door)
        self.apis = dict(apis)  # sniff_schema's names -> the endpoints that serve them

    @answers
    def post(self, call: Call) -> Response:
        body = call.json()
        schema = sniff_schema(body, self.service.engine.embeds_only)
        if schema == "chat":
            body.pop("inputs", None)  # documented: messages wins when a body carries both
        sse = "text/event-stream" in call.headers.get("Accept", "")
        framing = "sse" if sse else self.service.settings.output_formatter
        return self.apis[schema](call, body, framing)


# fields of a Responses request that an embeddings body does not have: any of them makes an ``input`` body a
# Responses request
_RESPONSES_ONLY = frozenset(ResponsesRequest.model_fields) - frozenset(EmbeddingRequestBody.model_fields)


def sniff_schema(body: dict, embeds_only: bool = False) -> str:
    if "requestType" in body:
        return "session"
    if "messages" in body:
        return "chat"
    if "inputs" in body:
        return "legacy"
    if "prompt" in body:
        return "completions"
    if "input" in body:
        return "embeddings" if embeds_only or not is_responses_body(body) else "responses"
    if "query" in body and ("texts" in body or "documents" in body):
        return "tei_rerank" if "texts" in body else "rerank"
    if "text_1" in body and "text_2" in body:
        return "score"
    raise BadRequest("the body has none of 'messages' (chat completions), 'inputs' (legacy schema), 'prompt' "
                     "(completions), 'input' (Responses, or embeddings), 'query' with 'texts' or 'documents' "
                     "(rerank) and 'text_1' with 'text_2' (score)", param="messages")


def is_responses_body(body: dict) -> bool:
    """``input`` with a field only Responses has (``instructions``, ``max_output_tokens``, ``stream``, ...), or an
    ``input`` list holding items (objects): a Responses request. ``input`` alone (text or token ids) stays the
    Databricks embeddings body it has always been here."""
    items = body.get("input")
    return bool(_RESPONSES_ONLY & body.keys()) or (isinstance(items, list) and any(isinstance(i, dict) for i in items))
