"""What every endpoint shares: the request as endpoints see it (``Call``), the worker's shared state (``FrontDoor``),
the moves of a route (parse under the extra-parameters policy, pick the adapter, submit and watch, build the
formatting context), the two ways to answer (one JSON object, or a stream of records in a framing), and errors
answered in the endpoint's own shape.

An ``Endpoint`` is one API. Its route functions take the ``Call`` first (``server``'s route table passes it) and are
wrapped by ``answers``: whatever they raise is answered in the endpoint's ``shape`` (a stream that already started
ends with one error record in that shape instead). A generation route is four moves: parse (``parse``), prepare
(the protocol model checks itself, the renderer renders, the model converts itself), submit (``submit``), format
(a formatter with its context, answered by ``json_response`` or ``stream_response``).

May import: the layers below the endpoints (errors, the engine's interface, metrics, process, parsing, prompt,
protocol, formatting, service, request_log, adapter_registry, sessions, store). Every endpoint module imports this
module and ``body``, and never another endpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from time import monotonic  # a request's arrival, which its deadline counts from; ``time.time`` dates answers
from typing import ClassVar

from flask import Response, current_app
from werkzeug.exceptions import HTTPException, MethodNotAllowed, RequestEntityTooLarge
from werkzeug.exceptions import NotFound as NoRoute
from werkzeug.routing import WebsocketMismatch

from handler import metrics
from handler.endpoints.body import parse_json, too_large
from handler.engine.types import GenerationRequest
from handler.errors import (
    BadRequest,
    EngineError,
    ErrorShape,
    NotFound,
    NotReady,
    Overloaded,
    ServingError,
    error_record,
)
from handler.formatting.context import FormatContext
from handler.formatting.framing import FRAMINGS, SSE_MIMETYPE, dumps
from handler.process.disconnect import DisconnectWatcher
from handler.prompt.renderer import PromptRenderer
from handler.protocol.adapters import ADAPTER_HEADERS
from handler.protocol.attributes import CUSTOM_ATTRIBUTES_HEADER, RequestProperties, parse_custom_attributes
from handler.protocol.common import EXTRA_PARAMETERS_HEADER, ExtraParameters, Extras, Model, parse_request
from handler.protocol.sessions import SESSION_ID_HEADER, SESSIONS_DISABLED
from handler.request_log import ObservedHandle, RequestRecord
from handler.service import ModelService
from handler.sessions import SessionStore
from handler.store import Store, open_store

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Call:
    """One request as an endpoint serves it: its headers, how to read its body, its record (the request log's line)
    and the client's connection. ``server``'s hooks make one per HTTP request; ``builtin_handle`` makes one for a
    user's handler, with no connection to watch; a WebSocket makes one per message, watched by its own close."""

    headers: Mapping[str, str]                  # case-insensitive names (werkzeug's Headers)
    read_body: Callable[[], bytes]              # the body under the server's limits (``body``)
    record: RequestRecord
    socket: socket.socket | None = None         # the client's connection, watched while it generates
    watch_keys: list[int] = field(default_factory=list)   # the watcher's keys, let go when the response closes
    parsed_properties: RequestProperties | None = None
    query: Mapping[str, str] = field(default_factory=dict)  # the query string's arguments (the first of each name)
    # hands the connection over for good (a WebSocket's upgrade: ``process.handover``); None: none to take
    take_socket: Callable[[], socket.socket | None] | None = None
    # how a request learns that its client left, where the connection watches itself (a WebSocket's close): it
    # takes the cancel to call; None: the disconnect watcher watches ``socket``
    on_client_gone: Callable[[Callable[[], None]], None] | None = None

    def json(self) -> dict:
        return parse_json(self.read_body())

    @property
    def properties(self) -> RequestProperties:
        """What the custom attributes say, read once (400 naming the header when it is malformed)."""
        if self.parsed_properties is None:
            self.parsed_properties = parse_custom_attributes(self.headers.get(CUSTOM_ATTRIBUTES_HEADER))
        return self.parsed_properties


class FrontDoor:
    """What the endpoints of one worker share: the model service, whether the server is draining, the thread that
    watches clients' connections, when the server started (``/v1/models``' ``created``), and the store of what
    outlives a request (stored responses, background runs, conversations; opened on first use)."""

    def __init__(self, service: ModelService, is_draining: Callable[[], bool],
                 count_work: Callable[[int], None] = lambda delta: None) -> None:
        self.service = service
        self.is_draining = is_draining
        self.watcher = DisconnectWatcher()  # cancels the generation of a client that closed its connection
        self.started = int(time.time())
        self._count_work = count_work
        self._store: Store | None = None
        self._store_lock = threading.Lock()

    @property
    def store(self) -> Store:
        with self._store_lock:  # one per worker: its background runs are known by the one that started them
            if self._store is None:
                self._store = open_store(self.service.settings, self._count_work)
            return self._store


def arrival() -> float:
    """Now, as the time a request arrived (``GenerationRequest.arrived_at``)."""
    return monotonic()


class Endpoint:
    """One API: its route functions, and the moves they share. ``shape``: how its errors are written; ``schema``:
    the request log's name for what it serves (None: the log's ``none``)."""

    shape: ClassVar[ErrorShape] = ErrorShape.OPENAI
    schema: ClassVar[str | None] = None

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.service = door.service

    def parse(self, call: Call, model: type[Model], body: dict) -> tuple[Model, Extras]:
        """Validate the body under the request's ``extra-parameters`` policy; the record keeps what it dropped."""
        policy = ExtraParameters.for_request(call.headers.get(EXTRA_PARAMETERS_HEADER),
                                             call.properties.extra_parameters, self.service.settings.extra_parameters)
        parsed, extras = parse_request(model, body, policy)
        call.record.ignored_fields = tuple(extras.ignored)
        return parsed, extras

    def note(self, call: Call, is_stream: bool, prompt: object) -> None:
        """What the request log says of the request: whether it streams, and its prompt when prompts are logged."""
        call.record.is_stream = is_stream
        if self.service.settings.log_prompts:
            call.record.prompt = prompt

    def renderer(self, generates: str | None = None) -> PromptRenderer:
        """The prompt renderer; for a generation request (``generates``: its prompt field) refused first when the
        model serves embeddings only, or is a cross-encoder."""
        if generates is not None and self.service.engine.embeds_only:
            raise BadRequest("this model is an encoder: it serves embeddings only (POST /v1/embeddings, or a body "
                             "with input on /invocations), not generation", param=generates)
        if generates is not None and self.service.engine.score_type == "cross-encoder":
            raise BadRequest("this model is a cross-encoder: it scores pairs (POST /rerank, /score), and does not "
                             "generate", param=generates)
        if not self.service.serves_builtin:  # a user's model.py serves without the built-in engine
            raise NotFound(self.service.engine.reason, code="not_found")
        if self.door.is_draining():
            raise NotReady("the server is stopping")
        if self.service.renderer is None or not self.service.engine.is_ready:
            raise NotReady("the model is still loading")
        return self.service.renderer

    def with_adapter(self, call: Call, generations: list[GenerationRequest],
                     model: str | None) -> list[GenerationRequest]:
        """The adapter a request picked: SageMaker's headers first, then the OpenAI ``model`` field when it names a
        registered adapter (vLLM's rule; any other name is the base model), else what the body's own fields said
        (legacy ``parameters.adapters`` / ``adapter_id``, already on each request)."""
        header = next((h for h in ADAPTER_HEADERS if call.headers.get(h)), None)
        if header is not None:
            name, param = call.headers[header], header
        elif model and model != self.service.model_name and model in self._adapter_names():
            name, param = model, "model"
        else:
            return generations
        return [dataclasses.replace(g, adapter=name, adapter_param=param) for g in generations]

    def _adapter_names(self) -> set[str]:
        store = self.service.adapters
        return set() if store is None else {info.name for info in store.list()}

    def sessions(self, param: str) -> SessionStore:
        """The stateful sessions; a 400 naming ``param`` while they are off."""
        store = self.service.sessions
        if store is None:
            raise BadRequest(f"{SESSIONS_DISABLED}: start the server with SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true "
                             "(option.enable_stateful_sessions)", param=param, code="sessions_disabled")
        return store

    def with_call(self, call: Call, generation: GenerationRequest) -> GenerationRequest:
        """What the request's headers add: its priority (the body's own, else ``x-priority`` in the custom
        attributes, else 0) and its stateful session (400 when sessions are off or the id is not a live one)."""
        priority = generation.priority if generation.priority is not None else call.properties.priority or 0
        session_id = call.headers.get(SESSION_ID_HEADER)
        session = self.sessions(SESSION_ID_HEADER).get(session_id).ref() if session_id else None
        return dataclasses.replace(generation, priority=priority, session=session)

    def submit(self, call: Call, generation: GenerationRequest,
               detached: RequestRecord | None = None) -> ObservedHandle:
        """Queue one request with the engine (429 past the wait queue's bound), watched: a client that closes its
        connection cancels it. The request's headers add its priority and session first (``with_call``).
        ``detached``: a generation that outlives its request (a background response), read into a record of its own
        and not watched."""
        generation = self.with_call(call, generation)
        store = self.service.adapters if generation.adapter is not None else None
        if store is not None:
            store.sync()  # registered or removed by another worker since: the engine resolves from this worker's
        try:
            handle = self.service.engine.submit(generation)
        except Overloaded:
            metrics.record_rejection()
            raise
        finally:
            self.record_adapter_events()
        call.record.adapter = generation.adapter
        if detached is None:
            self._watch(call, handle)
        if not call.record.has_engine_id:  # a legacy batch is known by its first prompt's id
            call.record.request_id = generation.request_id
            call.record.has_engine_id = True
        return ObservedHandle(handle, detached or call.record)

    def _watch(self, call: Call, handle) -> None:
        """Cancel ``handle`` as soon as the client's connection closes (not only when a write fails); the request
        log says why. A request of several generations (a legacy batch) shares one watch of its socket."""
        record = call.record

        def on_close() -> None:
            record.client_closed = True
            handle.cancel()

        if call.on_client_gone is not None:
            call.on_client_gone(on_close)
        elif call.socket is not None:
            call.watch_keys.append(self.door.watcher.watch(call.socket, on_close))

    def submit_all(self, call: Call, generations: list[GenerationRequest]) -> list[ObservedHandle]:
        """Each request submitted; when one is refused, those already queued are cancelled."""
        handles: list[ObservedHandle] = []
        try:
            for generation in generations:
                handles.append(self.submit(call, generation))
        except ServingError:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    def record_adapter_events(self) -> None:
        store = self.service.adapters
        for event, name in (() if store is None else store.drain_events()):
            metrics.record_adapter_event(name, event)

    def context(self, kind: type[FormatContext], request_id: str, model: str | None, **options) -> FormatContext:
        """The formatting context of an answer: its id, model name, date and how to spell a token, and ``options``
        (the schema's own)."""
        renderer = self.service.renderer
        return kind(request_id=request_id, model=model or self.service.model_name, created=int(time.time()),
                    token_text=renderer.token_text, token_bytes=renderer.token_bytes, **options)

    def stream_error(self, error: ServingError) -> dict:
        """The last record of a stream that failed after its first byte, in this endpoint's shape."""
        return error_record(error, self.shape)


def answers(route: Callable[..., Response]) -> Callable[..., Response]:
    """An endpoint's route function (``self``, then the ``Call``): the record learns the endpoint's schema, and an
    error it raises is answered in the endpoint's shape."""

    @functools.wraps(route)
    def answered(self: Endpoint, call: Call, *args, **kwargs) -> Response:
        if self.schema is not None:
            call.record.schema = self.schema
        try:
            return route(self, call, *args, **kwargs)
        except Exception as error:  # every error a client sees is a ServingError: unexpected ones become a 500
            return error_response(serving_error_of(error), self.shape)

    return answered


def serving_error_of(error: Exception, method: str = "", path: str = "") -> ServingError:
    """What a client is told of ``error``: a ``ServingError`` as it is; werkzeug's errors (no such route, a method
    the route does not take, its own body limit) with their status; anything else a 500 naming only its type (the
    traceback goes to the log)."""
    if isinstance(error, ServingError):
        return error
    if isinstance(error, RequestEntityTooLarge):
        return too_large(current_app.config.get("MAX_CONTENT_LENGTH"))
    if isinstance(error, NoRoute):
        return NotFound(f"{method} {path}: no such route", code="not_found")
    if isinstance(error, WebsocketMismatch):  # a plain request on a WebSocket's path, or an upgrade on another
        return BadRequest(f"{method} {path}: a WebSocket (Connection: Upgrade, Upgrade: websocket) opens on "
                          "/invocations-bidirectional-stream and the routes it may be moved to; other requests "
                          "are plain HTTP", code="websocket_mismatch")
    if isinstance(error, HTTPException):
        wrapped = ServingError(error.description or error.name)
        if isinstance(error, MethodNotAllowed):
            wrapped = ServingError(f"method {method} is not allowed on {path}", code="method_not_allowed")
        wrapped.status_code, wrapped.error_type = error.code or 500, "invalid_request_error"
        return wrapped
    log.exception("unexpected error")
    return EngineError(f"internal error ({type(error).__name__}); see the server log")


def error_response(error: ServingError, shape: ErrorShape) -> Response:
    if error.status_code >= 500:
        log.warning("request failed: %s", error.message)
    return json_response(error_record(error, shape), error.status_code)


def json_response(payload: object, status: int = 200) -> Response:
    return Response(dumps(payload), status=status, mimetype="application/json")


def stream_response(records: Iterable[dict], framing: str, handles: list[ObservedHandle],
                    on_error: Callable[[ServingError], dict]) -> Response:
    """Stream records in the chosen framing; a failure after the first byte becomes a final error record
    (``on_error``: the endpoint's shape, or the stream's own failure event)."""
    frame, mimetype = FRAMINGS[framing]

    def guarded() -> Iterator[dict]:
        try:
            yield from records
        except ServingError as error:
            yield on_error(error)
        except Exception as error:  # the status is already 200: say it in the stream instead
            log.exception("stream failed")
            yield on_error(EngineError(f"internal error ({type(error).__name__}); see the server log"))
        finally:
            for handle in handles:  # a client that went away frees its batch slots
                handle.cancel()

    headers = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"} if mimetype == SSE_MIMETYPE else {}
    return Response(frame(guarded()), mimetype=mimetype, headers=headers)
