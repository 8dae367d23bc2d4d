"""The Flask app: the route table and the hooks around every request. Each API is an endpoint of its own
(``handler.endpoints``); this module only says which route goes where.

The hooks: before a request, its ``Call`` (headers, body reader, request record, the client's connection); after
it, the response is tagged (``X-Request-Id``: the completion's id once a request reached the engine, a fresh one
for requests refused before; ``extra-parameters-ignored``: body fields the ``extra-parameters`` policy dropped;
``X-Request-Timeout`` on an answer the deadline cut; ``endpoint-load-metrics``, an ORCA load report, when the request
asks with ``endpoint-load-metrics-format``; under ``option.async_inference`` a stream gathered into one body with a
``Content-Length``, which asynchronous endpoints require), and once it has been sent the request is logged and
counted (``request_log``). Errors no endpoint answered (no such route, a method a route does not take) are written
in the shape of their path: OpenAI's on ``/v1/*``, the legacy one elsewhere.

A new API is one module in ``handler/endpoints/`` and its lines in ``route_table`` (and, when ``/invocations``
should take its bodies, a name in ``sniff_schema`` and its entry in ``apis``).

May import: everything below it: the endpoints, ``handler.djl`` (when a user's handler serves ``/invocations``),
``request_log`` and the process room's disconnect watcher (through the endpoints' ``FrontDoor``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import quote

from flask import Flask, Response, g, request
from werkzeug.exceptions import MethodNotAllowed

from handler import metrics, request_log
from handler.djl.routes import UserInvocations
from handler.endpoints.adapters import Adapters
from handler.endpoints.base import Call, FrontDoor, error_response, serving_error_of
from handler.endpoints.bidirectional import BidirectionalStream
from handler.endpoints.body import read_body
from handler.endpoints.chat import Chat
from handler.endpoints.completions import Completions
from handler.endpoints.conversations import Conversations
from handler.endpoints.embeddings import Embeddings
from handler.endpoints.health import Health
from handler.endpoints.invocations import Invocations
from handler.endpoints.legacy import Legacy
from handler.endpoints.models import Models
from handler.endpoints.rerank import Rerank, Score
from handler.endpoints.responses import Responses
from handler.endpoints.sessions import Sessions
from handler.endpoints.tokenizer import Tokenizer
from handler.errors import ErrorShape
from handler.process.handover import take_socket
from handler.protocol.common import new_request_id
from handler.service import ModelService

IGNORED_HEADER = "extra-parameters-ignored"
# on a non-streaming answer that option.request_timeout cut (finish_reason "length"): the timeout, in seconds
TIMEOUT_HEADER = "X-Request-Timeout"
UNLOGGED_ROUTES = frozenset({"/ping", "/metrics"})  # SageMaker pings every few seconds; scrapes are not traffic


class Route(NamedTuple):
    method: str
    rule: str
    answer: Callable[..., Response]  # an endpoint's route function: (call, **the rule's variables)
    websocket: bool = False          # the rule takes WebSocket upgrades only (and plain requests never)


def route_table(door: FrontDoor) -> list[Route]:
    chat, completions, legacy = Chat(door), Completions(door), Legacy(door)
    responses, embeddings, models, tokenizer = Responses(door), Embeddings(door), Models(door), Tokenizer(door)
    adapters, health, sessions, conversations = Adapters(door), Health(door), Sessions(door), Conversations(door)
    rerank, score = Rerank(door), Score(door)
    invocations = Invocations(door, apis={"chat": chat.serve, "legacy": legacy.serve, "completions": completions.serve,
                                          "embeddings": embeddings.serve, "responses": responses.serve,
                                          "session": sessions.serve, "tei_rerank": rerank.tei.serve,
                                          "rerank": rerank.serve, "score": score.serve})
    if door.service.user_handler is not None:  # a user's model.py answers /invocations, and may call ours
        invocations = UserInvocations(door, builtin=invocations)
    # a WebSocket's messages are requests to one of these routes (SageMaker's Model-Invocation-Path picks which)
    streams = BidirectionalStream(door, routes={"/invocations": invocations.post, "/v1/chat/completions": chat.post,
                                                "/v1/completions": completions.post, "/v1/responses": responses.post,
                                                "/v1/embeddings": embeddings.post})
    return [
        *(Route("GET", path, streams.connect, websocket=True) for path in streams.paths),
        Route("GET", "/ping", health.ping),
        Route("GET", "/metrics", health.metrics),
        Route("POST", "/invocations", invocations.post),
        Route("POST", "/v1/chat/completions", chat.post),
        Route("POST", "/v1/completions", completions.post),
        Route("POST", "/v1/embeddings", embeddings.post),
        Route("POST", "/rerank", rerank.either),
        Route("POST", "/v1/rerank", rerank.post),
        Route("POST", "/v2/rerank", rerank.post),
        Route("POST", "/score", score.post),
        Route("POST", "/v1/score", score.post),
        Route("POST", "/v1/responses", responses.post),
        Route("GET", "/v1/responses/<response_id>", responses.get),
        Route("DELETE", "/v1/responses/<response_id>", responses.delete),
        Route("POST", "/v1/responses/<response_id>/cancel", responses.cancel),
        Route("GET", "/v1/responses/<response_id>/input_items", responses.input_items),
        Route("POST", "/v1/conversations", conversations.create),
        Route("GET", "/v1/conversations/<conversation_id>", conversations.get),
        Route("POST", "/v1/conversations/<conversation_id>", conversations.update),
        Route("DELETE", "/v1/conversations/<conversation_id>", conversations.delete),
        Route("GET", "/v1/conversations/<conversation_id>/items", conversations.list_items),
        Route("POST", "/v1/conversations/<conversation_id>/items", conversations.add_items),
        Route("GET", "/v1/conversations/<conversation_id>/items/<item_id>", conversations.get_item),
        Route("DELETE", "/v1/conversations/<conversation_id>/items/<item_id>", conversations.delete_item),
        Route("GET", "/v1/models", models.list_all),
        Route("GET", "/v1/models/<path:model_id>", models.get),
        Route("POST", "/generate", legacy.generate),
        Route("POST", "/generate_stream", legacy.generate_stream),
        Route("POST", "/", legacy.tgi_root),
        Route("POST", "/tokenize", tokenizer.tokenize),
        Route("POST", "/detokenize", tokenizer.detokenize),
        Route("POST", "/adapters", adapters.register),
        Route("GET", "/adapters", adapters.list_all),
        Route("DELETE", "/adapters/<path:name>", adapters.unregister),
    ]


def create_app(service: ModelService, is_draining: Callable[[], bool] = lambda: False,
               count_work: Callable[[int], None] = lambda delta: None) -> Flask:
    """The app; ``count_work`` tells the SIGTERM drain of work in flight besides requests (background responses)."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = service.settings.max_request_size
    request_log.configure_logging(service.settings.log_level)
    door = FrontDoor(service, is_draining, count_work)
    for route in route_table(door):
        name = f"{'WEBSOCKET' if route.websocket else route.method} {route.rule}"
        app.add_url_rule(route.rule, endpoint=name, view_func=_with_call(route.answer), methods=[route.method],
                         websocket=route.websocket)
    app.before_request(lambda: open_call(service.settings.max_request_size))
    app.after_request(lambda response: close_call(response, door))
    app.register_error_handler(Exception, unanswered_error)
    return app


def _with_call(answer: Callable[..., Response]) -> Callable[..., Response]:
    def view(**variables) -> Response:
        return answer(g.call, **variables)

    return view


# ---- hooks ------------------------------------------------------------------------------------------------------
def open_call(max_body_bytes: int) -> None:
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    environ = request.environ
    g.call = Call(request.headers, lambda: read_body(request, max_body_bytes),
                  request_log.start(new_request_id("req"), route),
                  environ.get("gunicorn.socket"),  # the socket is absent under a test client
                  query=request.args.to_dict(), take_socket=lambda: take_socket(environ))


def close_call(response: Response, door: FrontDoor) -> Response:
    """Tag the response with its id; log and count the request once the response has been sent. Under
    ``option.async_inference`` a streamed answer is gathered first, so it goes out with a Content-Length."""
    if response.is_streamed and door.service.settings.async_inference:
        response.make_sequence()  # the whole stream, its records in order (werkzeug then sets Content-Length)
    call: Call | None = g.get("call")
    record = call.record if call is not None else None
    response.headers["X-Request-Id"] = record.request_id if record is not None else new_request_id("req")
    if record is not None and record.ignored_fields:
        response.headers[IGNORED_HEADER] = ",".join(quote(name, safe="._-[]") for name in record.ignored_fields)
    if record is not None and record.cut_by_deadline:  # a non-streaming answer the deadline cut (request_log)
        response.headers[TIMEOUT_HEADER] = f"{door.service.settings.request_timeout:g}"
    load_format = call.headers.get(metrics.ORCA_FORMAT_HEADER) if call is not None else None
    load_report = metrics.orca_header(load_format) if load_format else None
    if load_report is not None:  # an ORCA load report, asked for as vLLM's routers ask
        response.headers[metrics.ORCA_HEADER] = load_report
    for key in call.watch_keys if call is not None else ():
        response.call_on_close(lambda key=key: door.watcher.unwatch(key))
    if record is not None and record.route not in UNLOGGED_ROUTES:
        status = response.status_code
        response.call_on_close(lambda: request_log.finish(record, status))
    return response


def unanswered_error(error: Exception) -> Response:
    """An error no endpoint answered (no such route, a method the route does not take), in its path's shape."""
    shape = ErrorShape.OPENAI if request.url_rule is not None else ErrorShape.for_path(request.path)
    response = error_response(serving_error_of(error, request.method, request.path), shape)
    if isinstance(error, MethodNotAllowed) and error.valid_methods:
        response.headers["Allow"] = ", ".join(sorted(error.valid_methods))
    return response
