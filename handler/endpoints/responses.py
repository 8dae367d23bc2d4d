"""OpenAI's Responses API: ``POST /v1/responses`` (and a Responses body on ``/invocations``), ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and ``GET /v1/responses/{id}/input_items``.

A request is converted into the chat request it stands for (``protocol.responses``: the conversation it answers
becomes messages), prepared and served as chat is, and answered as a ``response`` object or its typed stream events
(``formatting.responses``). Errors in OpenAI's shape, naming the Responses fields: whatever fails about the chat
request it became is relabelled here, once (``protocol.responses.responses_error``).

The conversation a request answers: the stored one it continues (``previous_response_id``: that response's
conversation and output), or a conversation's items (``conversation``, ``endpoints.conversations``), then its own
input. Reasoning items in it are rendered: a sealed one (``encrypted_content``) is opened with the deployment's key
(a 400 naming it when it does not open). With ``store`` (the default) the response is kept in the store the workers
share (``handler.store``), so any worker finds it; with ``conversation`` its input and output are added to the
conversation when it ends. ``background`` answers at once with the ``queued`` response and generates on a thread of
this worker (``handler.store.background``), which any worker can poll, stream again from an event, or cancel.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator

from flask import Response

from handler import request_log
from handler.endpoints.base import Call, Endpoint, answers, arrival, json_response, stream_response
from handler.engine.types import GenerationRequest
from handler.errors import BadRequest, NotFound, ServingError
from handler.formatting.conversations import item_list
from handler.formatting.responses import (
    ResponseEvents,
    ResponsesContext,
    deleted,
    error_event,
    response,
    response_object,
)
from handler.protocol.chat import ChatCompletionRequest, PreparedChat
from handler.protocol.common import parse_model
from handler.protocol.conversations import ListQuery
from handler.protocol.response_items import plain_reasoning
from handler.protocol.response_tools import ToolSet
from handler.protocol.responses import ResponsesRequest, new_response_id, responses_error, responses_param
from handler.store.background import BackgroundRun, replay
from handler.store.responses import StoredResponse

log = logging.getLogger(__name__)


class Responses(Endpoint):
    schema = "responses"

    @property
    def store(self):
        return self.door.store

    @answers
    def post(self, call: Call) -> Response:
        return self.serve(call, call.json(), "sse")

    @answers
    def get(self, call: Call, response_id: str) -> Response:
        stored = self._stored(response_id)
        if call.query.get("stream") not in ("true", "1"):
            return json_response(stored.response)
        if not (stored.background and stored.stream):
            raise BadRequest("only a background response created with stream: true can be streamed again",
                             param="stream")
        try:
            after = int(call.query.get("starting_after", -1))
        except ValueError:
            raise BadRequest("starting_after is a sequence number", param="starting_after") from None
        return stream_response(replay(self.store.runs, response_id, after), "typed_sse", [],
                               lambda error: error_event(error, after))

    @answers
    def delete(self, call: Call, response_id: str) -> Response:
        if not self.store.responses.delete(response_id):
            raise self._unknown(response_id, "response_id")
        return json_response(deleted(response_id))

    @answers
    def cancel(self, call: Call, response_id: str) -> Response:
        """A background response stops (on whichever worker generates it) and is ``cancelled``; one that already
        ended is answered as it is (OpenAI: cancelling again changes nothing)."""
        stored = self._stored(response_id)
        if not stored.background:
            raise BadRequest("only a background response can be cancelled", param="response_id")
        if self.store.responses.cancel(response_id):
            self.store.runs.cancel(response_id)  # this worker's own run stops now, another's at its watcher's poll
        return json_response(self._stored(response_id).response)

    @answers
    def input_items(self, call: Call, response_id: str) -> Response:
        """The items the response answered (its conversation: earlier turns, then its own input), a page at a time."""
        query = parse_model(ListQuery, dict(call.query))
        page, has_more = query.page(self._stored(response_id).items)
        return json_response(item_list(page, has_more))

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        """Converted into the chat request and served as chat is; formatted as a ``response`` object or typed
        events; kept in the store unless ``store`` is false."""
        parsed, extras = self.parse(call, ResponsesRequest, body)
        self.note(call, parsed.stream, body.get("input"))
        renderer = self.renderer(generates="input")
        parsed.check()
        items, fields = self._conversation(parsed)
        tools = parsed.tool_set
        arrived = arrival()

        def prepare(chat: ChatCompletionRequest, message_fields: list[str]) -> PreparedChat:
            try:
                return chat.prepare(renderer, self.service.defaults.temperature, arrived)
            except ServingError as error:
                raise responses_error(error, message_fields, tools.fields) from None

        prepared, message_fields, dropped = parsed.fitted(items, fields, self._reasoning_text, prepare,
                                                          self.service.engine.limits.max_model_len)
        _log_tools(tools, dropped)
        generation = extras.apply(_as_response(prepared.generation, message_fields))
        ctx = self.context(ResponsesContext, generation.request_id, parsed.model, echo=parsed.echo(),
                           tool_format=prepared.plan.tool_format, tool_calls_only=prepared.plan.calls_only,
                           reasoning_parser=prepared.reasoning_parser, reasoning_opened=prepared.reasoning_opened,
                           want_logprobs=parsed.wants_logprobs, namespaced=tools.namespaced, queued=parsed.background,
                           seal=self.store.seal.seal if parsed.seals_reasoning else None)
        framing = "typed_sse" if framing == "sse" else framing
        try:
            if parsed.background:
                return self._background(call, parsed, generation, ctx, items, framing)
            handle = self.submit(call, generation)
        except ServingError as error:
            raise responses_error(error, message_fields) from None
        keep = self._keeper(parsed, items)
        if not parsed.stream:
            try:
                result = response(handle, ctx)
            finally:
                handle.cancel()
            keep(result)
            return json_response(result)
        stream = ResponseEvents(ctx)
        records = _keeping(stream.events(handle), keep)
        return stream_response(records, framing, [handle], stream.error_event)

    def _background(self, call: Call, parsed: ResponsesRequest, generation: GenerationRequest,
                    ctx: ResponsesContext, items: list[dict], framing: str) -> Response:
        """Stored ``queued`` and generated on a thread of this worker; answered with the queued response, or (with
        ``stream``) with its events as the run writes them."""
        if self.store.responses.capacity == 0:
            raise BadRequest("background responses are kept in the store, and this server stores none "
                             "(option.responses_store_size=0)", param="background")
        record = request_log.start(generation.request_id, f"{call.record.route} (background)")  # its own log line
        record.schema, record.is_stream = self.schema, parsed.stream
        handle = self.submit(call, generation, detached=record)  # 429 here, before anything is stored
        queued = response_object(ctx, "queued", [])
        self.store.responses.put(StoredResponse(queued, items, background=True, stream=parsed.stream,
                                                owner=os.getpid()))
        add = self._conversation_adder(parsed, items)
        self.store.runs.start(BackgroundRun(generation.request_id, handle, ResponseEvents(ctx), parsed.stream, record,
                                            on_done=add))
        if not parsed.stream:
            return json_response(queued)
        return stream_response(replay(self.store.runs, generation.request_id, -1), framing, [],
                               lambda error: error_event(error, -1))

    def _conversation(self, parsed: ResponsesRequest) -> tuple[list[dict], list[str]]:
        """The items a request answers (the stored conversation it continues, then its own input) and the field
        each came from."""
        own = parsed.input_items()
        history, field = [], "input"
        if parsed.previous_response_id is not None:
            history, field = self._stored(parsed.previous_response_id, "previous_response_id").conversation, \
                "previous_response_id"
        elif parsed.conversation_id is not None:
            found = self.store.conversations.items(parsed.conversation_id)
            if found is None:
                raise NotFound(f"no conversation with id '{parsed.conversation_id}'", param="conversation",
                               code="conversation_not_found")
            history, field = found, "conversation"
        return history + own, [field] * len(history) + [f"input[{i}]" for i in range(len(own))]

    def _reasoning_text(self, item: dict, field: str) -> str | None:
        """A reasoning item's text to render: its sealed content opened, else its own text."""
        blob = item.get("encrypted_content")
        if not blob:
            return plain_reasoning(item, field)
        text = self.store.seal.open(blob)
        if text is None:
            raise BadRequest("the reasoning item's encrypted_content cannot be read here: it was sealed under a key "
                             "this server does not hold (another deployment, or a key rotated out of "
                             "option.responses_encryption_key), or altered", param=f"{field}.encrypted_content",
                             code="invalid_encrypted_content")
        return text

    def _keeper(self, parsed: ResponsesRequest, items: list[dict]) -> Callable[[dict], None]:
        """What a finished response does: kept in the store (``store``), added to its conversation."""
        add = self._conversation_adder(parsed, items)

        def keep(result: dict) -> None:
            if parsed.store:
                self.store.responses.put(StoredResponse(result, items))
            add(result)

        return keep

    def _conversation_adder(self, parsed: ResponsesRequest, items: list[dict]) -> Callable[[dict], None]:
        conversation, num_own = parsed.conversation_id, len(parsed.input_items())
        if conversation is None:
            return lambda result: None
        own = items[len(items) - num_own:]
        return lambda result: self.store.conversations.add_items(conversation, own + result["output"])

    def _stored(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self.store.responses.get(response_id)
        if stored is None:
            raise self._unknown(response_id, param)
        return stored

    def _unknown(self, response_id: str, param: str) -> NotFound:
        return NotFound(f"no response with id '{response_id}' is stored (the server keeps the latest "
                        f"{self.store.responses.capacity}, on this instance)", param=param,
                        code="previous_response_not_found" if param == "previous_response_id"
                        else "response_not_found")


_LOGGED_LEFT_OUT: set[str] = set()


def _log_tools(tools: ToolSet, dropped: int) -> None:
    """Say in the log what the model was not shown: the tools it cannot be offered (once per kind per worker; they
    come with every request of a client that offers them by default), and items truncation dropped."""
    for field, kind in tools.left_out:
        if kind not in _LOGGED_LEFT_OUT:
            _LOGGED_LEFT_OUT.add(kind)
            log.info("Responses: %s (type %s) is a tool this server cannot run; it is left out of what the model "
                     "sees (said once per kind)", field, kind)
    if dropped:
        log.info("Responses: truncation auto dropped the %d oldest items to fit the context", dropped)


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
