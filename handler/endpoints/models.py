"""OpenAI's model list: ``GET /v1/models`` and ``GET /v1/models/{id}``, the one model this server serves (with the
engine path that serves it once loaded). Errors in OpenAI's shape (``model_not_found``)."""

from __future__ import annotations

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, json_response
from handler.errors import NotFound


class Models(Endpoint):
    @answers
    def list_all(self, call: Call) -> Response:
        return json_response({"object": "list", "data": [self._card()]})

    @answers
    def get(self, call: Call, model_id: str) -> Response:
        if model_id != self.service.model_name:
            raise NotFound(f"the model '{model_id}' does not exist; this server serves '{self.service.model_name}'",
                           param="model", code="model_not_found")
        return json_response(self._card())

    def _card(self) -> dict:
        card = {"id": self.service.model_name, "object": "model", "created": self.door.started,
                "owned_by": "sagemaker-llm-container"}
        engine_path = self.service.engine_path
        return card if engine_path is None else {**card, "engine_path": engine_path}
