"""SageMaker's LoRA adapter administration: ``POST /adapters`` (register a PEFT folder or ``s3://`` prefix by name),
``GET /adapters`` and ``DELETE /adapters/{name}``, kept equal across the workers (``adapter_registry``). Served once
the model has loaded with ``option.enable_lora``; errors in OpenAI's shape.

A registration's fields come in a JSON body, or, with no body, in the query string (``POST
/adapters?name=x&src=y``, ``preload`` and ``pin`` as ``true`` / ``false``): the standards package takes both."""

from __future__ import annotations

from flask import Response

from handler.adapter_registry import SharedAdapters
from handler.endpoints.base import Call, Endpoint, answers, json_response
from handler.endpoints.body import parse_json
from handler.engine.types import AdapterInfo
from handler.errors import BadRequest, NotReady
from handler.protocol.adapters import RegisterAdapter
from handler.protocol.common import ExtraParameters, parse_request


class Adapters(Endpoint):
    @answers
    def register(self, call: Call) -> Response:
        raw = call.read_body()
        fields = parse_json(raw) if raw.strip() else dict(call.query)
        body, _extras = parse_request(RegisterAdapter, fields, ExtraParameters.ERROR)
        info = self._store().register(body.name, body.src, preload=body.preload, pin=body.pin)
        self.record_adapter_events()
        return json_response({"message": f"Adapter {body.name} registered", "adapter": _card(info)})

    @answers
    def unregister(self, call: Call, name: str) -> Response:
        self._store().unregister(name)
        return json_response({"message": f"Adapter {name} unregistered"})

    @answers
    def list_all(self, call: Call) -> Response:
        return json_response({"adapters": [_card(info) for info in self._store().list()]})

    def _store(self) -> SharedAdapters:
        if not self.service.engine.is_ready:
            raise NotReady("the model is still loading")
        store = self.service.adapters
        if store is None:
            raise BadRequest("this server serves no LoRA adapters: start it with option.enable_lora=true "
                             "(OPTION_ENABLE_LORA=true)", param="option.enable_lora")
        return store


def _card(info: AdapterInfo) -> dict:
    return {"name": info.name, "src": info.src, "pinned": info.pinned, "loaded": info.loaded, "rank": info.rank,
            "target_modules": list(info.targets)}
