"""OpenAI's Responses API: ``POST /v1/responses`` (and a Responses body on ``/invocations``), ``GET`` and
``DELETE /v1/responses/{id}``, with the store of the responses this worker answered.

A request is converted into the chat request it stands for (``protocol.responses``: its conversation and input
items become messages), prepared and served as chat is, and answered as a ``response`` object or its typed stream
events (``formatting.responses``). Errors in OpenAI's shape, naming the Responses fields: whatever fails about the
chat request it became is relabelled here, once (``protocol.responses.responses_error``).

The store (``store``, unless the request says ``store: false``): the responses this worker process answered, most
recently used last, at most ``option.responses_store_size`` (the least recently used is forgotten first; 0 stores
nothing). Each entry is the response object and the conversation it answered, so a continuation
(``previous_response_id``) is that conversation, the response's output, then the new input. Nothing is shared
between gunicorn workers or survives a restart: README's "Responses API" says what that means behind SageMaker.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from flask import Response

from handler.endpoints.base import Call, Endpoint, FrontDoor, answers, arrival, json_response, stream_response
from handler.engine.types import GenerationRequest
from handler.errors import NotFound, ServingError
from handler.formatting.responses import ResponseEvents, ResponsesContext, deleted, response
from handler.protocol.responses import ResponsesRequest, new_response_id, responses_error, responses_param


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict                  # the response object as the client got it
    items: tuple[dict, ...]         # the conversation it answered: earlier turns, then its own input items

    @property
    def conversation(self) -> list[dict]:
        """What a response continuing this one starts from: the items, then this response's output."""
        return [*self.items, *self.response["output"]]


class ResponseStore:
    """A bounded LRU map from response id to ``StoredResponse``, safe to use from the worker's threads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._entries[stored.response["id"]] = stored
            self._entries.move_to_end(stored.response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)


class Responses(Endpoint):
    schema = "responses"

    def __init__(self, door: FrontDoor) -> None:
        super().__init__(door)
        self.store = ResponseStore(self.service.settings.responses_store_size)  # this worker's stored responses

    @answers
    def post(self, call: Call) -> Response:
        return self.serve(call, call.json(), "sse")

    @answers
    def get(self, call: Call, response_id: str) -> Response:
        return json_response(self._stored(response_id).response)

    @answers
    def delete(self, call: Call, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise self._unknown(response_id, "response_id")
        return json_response(deleted(response_id))

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        """Converted into the chat request and served as chat is; formatted as a ``response`` object or typed
        events; kept in this worker's store unless ``store`` is false."""
        parsed, extras = self.parse(call, ResponsesRequest, body)
        self.note(call, parsed.stream, body.get("input"))
        renderer = self.renderer(generates="input")
        history = self._conversation(parsed)
        parsed.check()
        chat, fields = parsed.to_chat(history)
        try:  # what fails about the chat request names the Responses field it came from
            prepared = chat.prepare(renderer, self.service.defaults.temperature, arrival())
            generation = extras.apply(_as_response(prepared.generation, fields))
            handle = self.submit(call, generation)
        except ServingError as error:
            raise responses_error(error, fields) from None
        ctx = self.context(ResponsesContext, generation.request_id, parsed.model, echo=parsed.echo(),
                           tool_format=prepared.plan.tool_format, tool_calls_only=prepared.plan.calls_only,
                           reasoning_parser=prepared.reasoning_parser, reasoning_opened=prepared.reasoning_opened)
        keep = (lambda result: self.store.put(StoredResponse(result, tuple(history)))) \
            if parsed.store else (lambda result: None)
        if not parsed.stream:
            try:
                result = response(handle, ctx)
            finally:
                handle.cancel()
            keep(result)
            return json_response(result)
        stream = ResponseEvents(ctx)
        records = _keeping(stream.events(handle), keep)
        return stream_response(records, "typed_sse" if framing == "sse" else framing, [handle], stream.error_event)

    def _conversation(self, parsed: ResponsesRequest) -> list[dict]:
        """The items a request answers: the stored conversation it continues, then its own input."""
        if parsed.previous_response_id is None:
            return parsed.input_items()
        return self._stored(parsed.previous_response_id, "previous_response_id").conversation + parsed.input_items()

    def _stored(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise self._unknown(response_id, param)
        return stored

    def _unknown(self, response_id: str, param: str) -> NotFound:
        return NotFound(f"no response with id '{response_id}' is stored in this worker (responses are kept in the "
                        f"memory of the worker that answered them, the latest {self.store.capacity})",
                        param=param, code="previous_response_not_found" if param == "previous_response_id"
                        else "response_not_found")


def _as_response(generation: GenerationRequest, fields: list[str]) -> GenerationRequest:
    """The chat request's engine request as the Responses request's: its id, and the fields errors name."""
    grammar = generation.grammar
    if grammar is not None:
        grammar = dataclasses.replace(grammar, param=responses_param(grammar.param, fields) or grammar.param)
    return dataclasses.replace(generation, request_id=new_response_id(), prompt_param="input", grammar=grammar)


def _keeping(records: Iterable[dict], keep: Callable[[dict], None]) -> Iterator[dict]:
    """Pass a Responses stream through, keeping the finished response when it ends (not a failed one)."""
    for record in records:
        if record["type"] in ("response.completed", "response.incomplete"):
            keep(record["response"])
        yield record
