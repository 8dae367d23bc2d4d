"""Rerank and score: TEI's ``POST /rerank``; the Cohere / Jina shape vLLM serves (``/rerank``, ``/v1/rerank``,
``/v2/rerank``); vLLM's ``POST /score`` and ``/v1/score``; and those bodies on ``/invocations``.

``/rerank`` takes either rerank shape, by its fields: ``texts`` is TEI's, else Cohere's (``documents``). Each request
becomes a ``protocol.rerank.ScoringAsk``, scored as the model can (``Scoring.scores``): a cross-encoder reads each
pair in one forward on the engine's thread (``score``); an embedding model's score is the cosine of the two texts'
embeddings (``embed``), as vLLM scores with one; a generating model is refused (400). The answers are
``formatting.rerank``'s, never streamed. Errors: TEI's route in the legacy shape (TEI's own ``{error,
error_type}``), the others in OpenAI's (vLLM's).
"""

from __future__ import annotations

import time

from flask import Response

from handler.endpoints.base import Call, Endpoint, FrontDoor, answers, arrival, json_response
from handler.errors import BadRequest, ErrorShape
from handler.formatting.rerank import rerank_object, score_list, tei_ranks
from handler.protocol.common import new_request_id
from handler.protocol.rerank import RerankRequest, ScoreRequestBody, ScoringAsk, TeiRerankRequest


class Scoring(Endpoint):
    """The move rerank and score share: an ask's scores, from whichever kind of model is served."""

    schema = "rerank"

    def scores(self, call: Call, ask: ScoringAsk) -> tuple[list[float], int]:
        """Each pair's score, and the tokens the model read."""
        renderer = self.renderer()
        engine = self.service.engine
        kind = engine.score_type
        if kind is None:
            raise BadRequest("this model generates text: rerank and score take a cross-encoder (a "
                             "*ForSequenceClassification checkpoint) or an embedding model", param=ask.first_param)
        if kind == "cross-encoder":
            result = engine.score(ask.pairs_request(renderer, call.record.request_id, arrival())).result()
            scores, num_tokens = list(result.values), result.num_tokens
        else:  # an embedding model: the cosine of the two texts' vectors
            request = ask.texts_request(renderer, call.record.request_id, arrival(), engine.limits.max_model_len)
            embeddings = engine.embed(request).result()
            scores, num_tokens = ask.cosine(embeddings), embeddings.num_tokens
        call.record.num_prompt_tokens = num_tokens
        return scores, num_tokens


class TeiRerank(Scoring):
    """TEI's ``/rerank``: a sorted list of ranks; errors in TEI's (the legacy) shape."""

    shape = ErrorShape.LEGACY

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        parsed, _extras = self.parse(call, TeiRerankRequest, body)
        self.note(call, False, body.get("query"))
        self.renderer()  # ready (and not a user's handler) before the limits are read
        scores, _ = self.scores(call, parsed.ask(self.service.engine.limits.max_model_len))
        return json_response(tei_ranks(scores, parsed.texts if parsed.return_text else None))


class Rerank(Scoring):
    """The Cohere / Jina shape (``/v1/rerank``, ``/v2/rerank``), and ``/rerank`` for either shape."""

    def __init__(self, door: FrontDoor) -> None:
        super().__init__(door)
        self.tei = TeiRerank(door)

    @answers
    def post(self, call: Call) -> Response:
        return self.serve(call, call.json(), "json")

    @answers
    def either(self, call: Call) -> Response:
        """``/rerank``: TEI's shape when the body has ``texts``, else Cohere's."""
        body = call.json()
        return self.tei.serve(call, body, "json") if "texts" in body else self.serve(call, body, "json")

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        parsed, _extras = self.parse(call, RerankRequest, body)
        self.note(call, False, body.get("query"))
        scores, num_tokens = self.scores(call, parsed.ask())
        documents = parsed.texts() if parsed.return_documents else None
        return json_response(rerank_object(new_request_id("rerank"), parsed.model or self.service.model_name,
                                           scores, documents, parsed.top_n, num_tokens))


class Score(Scoring):
    """vLLM's ``/score`` and ``/v1/score``."""

    schema = "score"

    @answers
    def post(self, call: Call) -> Response:
        return self.serve(call, call.json(), "json")

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        parsed, _extras = self.parse(call, ScoreRequestBody, body)
        self.note(call, False, body.get("text_1"))
        scores, num_tokens = self.scores(call, parsed.ask())
        return json_response(score_list(new_request_id("score"), parsed.model or self.service.model_name,
                                        int(time.time()), scores, num_tokens))
