"""HTTP routes. Each one parses, converts, submits and formats; the schema and framing pick the functions.

``/invocations`` sniffs the body: ``messages`` means chat completions (it wins when ``inputs`` is there too),
else ``inputs`` means the legacy schema, else ``prompt`` means completions, else ``input`` means a Responses request
or embeddings (``sniff_schema`` says which), else 400 naming the fields.

The legacy schema's answers are spelled as LMI's or as TGI's (``LegacyShape``): TGI's on TGI's own routes
(``/generate``, ``/generate_stream``, ``POST /``), under ``option.legacy_response=tgi``, and for TGI's own client
(``huggingface_hub``'s ``InferenceClient``, known by its User-Agent), which streams only server-sent events.

The ``extra-parameters`` request header (Azure ML) says what to do with undeclared body fields (error, ignore,
pass-through; see ``protocol/common.py``); fields it dropped are named in the ``extra-parameters-ignored`` header.

Every response carries ``X-Request-Id`` (the completion's id once a request reached the engine, a fresh one for
requests refused before); when the response has been sent, the request is logged and counted (``request_log``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import quote

from flask import Flask, Response, g, request
from gunicorn.http.errors import ParseException
from werkzeug.exceptions import HTTPException, MethodNotAllowed, RequestEntityTooLarge
from werkzeug.exceptions import NotFound as NoRoute

from handler import intake, metrics, request_log
from handler.adapter_registry import SharedAdapters
from handler.djl_routes import install_user_handler
from handler.engine.types import AdapterInfo, GenerationRequest
from handler.errors import (
    BadRequest,
    EngineError,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ServingError,
)
from handler.formatting import chat as chat_format
from handler.formatting import completions as completions_format
from handler.formatting import embeddings as embeddings_format
from handler.formatting import legacy as legacy_format
from handler.formatting import responses as responses_format
from handler.formatting.context import (
    ChatContext,
    CompletionsContext,
    FormatContext,
    LegacyContext,
    ResponsesContext,
)
from handler.formatting.framing import FRAMINGS, SSE_MIMETYPE, dumps
from handler.process.disconnect import DisconnectWatcher
from handler.protocol import tokenize
from handler.protocol.adapters import ADAPTER_HEADERS, RegisterAdapter
from handler.protocol.chat import ChatCompletionRequest
from handler.protocol.common import (
    CUSTOM_ATTRIBUTES_HEADER,
    EXTRA_PARAMETERS_HEADER,
    ExtraParameters,
    Extras,
    Model,
    new_request_id,
    parse_request,
)
from handler.protocol.completions import CompletionRequest
from handler.protocol.embeddings import EmbeddingRequestBody
from handler.protocol.legacy import LegacyRequest
from handler.protocol.responses import ResponsesRequest, responses_error
from handler.request_log import ObservedHandle
from handler.response_store import StoredResponse
from handler.service import ModelService

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 6 * 1024 * 1024  # SageMaker's invoke_endpoint limit
IGNORED_HEADER = "extra-parameters-ignored"
# on a non-streaming answer that option.request_timeout cut (finish_reason "length"): the timeout, in seconds
TIMEOUT_HEADER = "X-Request-Timeout"
UNLOGGED_ROUTES = frozenset({"/ping", "/metrics"})  # SageMaker pings every few seconds; scrapes are not traffic


def create_app(service: ModelService, is_draining: Callable[[], bool] = lambda: False) -> Flask:
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    request_log.configure_logging(service.settings.log_level)
    routes = Routes(service, is_draining)

    app.add_url_rule("/ping", view_func=routes.ping, methods=["GET"])
    app.add_url_rule("/invocations", view_func=routes.invocations, methods=["POST"])
    app.add_url_rule("/v1/chat/completions", view_func=routes.chat_completions, methods=["POST"])
    app.add_url_rule("/v1/completions", view_func=routes.completions, methods=["POST"])
    app.add_url_rule("/v1/models", view_func=routes.models, methods=["GET"])
    app.add_url_rule("/v1/models/<path:model_id>", view_func=routes.model, methods=["GET"])
    app.add_url_rule("/metrics", view_func=routes.metrics, methods=["GET"])
    app.add_url_rule("/v1/embeddings", view_func=routes.embeddings, methods=["POST"])
    app.add_url_rule("/v1/responses", view_func=routes.responses, methods=["POST"])
    app.add_url_rule("/generate", view_func=routes.generate, methods=["POST"])
    app.add_url_rule("/generate_stream", view_func=routes.generate_stream, methods=["POST"])
    app.add_url_rule("/", view_func=routes.tgi_root, methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>", view_func=routes.stored_response, methods=["GET"])
    app.add_url_rule("/v1/responses/<response_id>", view_func=routes.delete_response, methods=["DELETE"])
    app.add_url_rule("/tokenize", view_func=routes.tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", view_func=routes.detokenize, methods=["POST"])
    app.add_url_rule("/adapters", view_func=routes.register_adapter, methods=["POST"])
    app.add_url_rule("/adapters", view_func=routes.list_adapters, methods=["GET"])
    app.add_url_rule("/adapters/<path:name>", view_func=routes.unregister_adapter, methods=["DELETE"])
    app.register_error_handler(ServingError, routes.serving_error)
    app.register_error_handler(HTTPException, routes.http_error)
    app.register_error_handler(Exception, routes.unexpected_error)
    app.before_request(routes.start_record)
    app.after_request(routes.finish_response)
    if service.user_handler is not None:
        install_user_handler(app, routes.invocations, service, read_body)
    return app


@dataclass(frozen=True, slots=True)
class LegacyShape:
    """How a legacy-schema answer is spelled."""

    is_tgi: bool        # TGI's names (formatting.legacy) and TGI's server-sent events when streaming
    one_object: bool    # a string input is answered with one object (LMI, TGI's /generate), not a one-element list


LMI_SHAPE = LegacyShape(is_tgi=False, one_object=True)
TGI_SAGEMAKER_SHAPE = LegacyShape(is_tgi=True, one_object=False)   # TGI's /invocations, the HF LLM DLC
TGI_ROUTES_SHAPE = LegacyShape(is_tgi=True, one_object=True)       # TGI's /generate, /generate_stream, POST /
# huggingface_hub's User-Agent ("...; hf_hub/2.4.0; ..."). Its InferenceClient reads only "data:" lines and sends
# "Accept: */*", as python-requests does (and JSON-lines callers with it), so the Accept header cannot tell it apart.
# SageMaker does not forward a caller's User-Agent, so nothing behind InvokeEndpoint is affected.
TGI_CLIENT_AGENT = "hf_hub/"


def _no_route() -> NotFound:
    """404 naming the route (on /v1/* in OpenAI's shape, elsewhere in the legacy shape)."""
    return NotFound(f"{request.method} {request.path}: no such route", code="not_found")


class Routes:
    def __init__(self, service: ModelService, is_draining: Callable[[], bool]) -> None:
        self.service = service
        self.is_draining = is_draining
        self.handlers = {"chat": self._chat, "legacy": self._legacy, "completions": self._completions,
                         "embeddings": self._embeddings, "responses": self._responses}
        self.created = int(time.time())  # /v1/models' "created": when this server started
        self.watcher = DisconnectWatcher()  # cancels the generation of a client that closed its connection

    # ---- routes -------------------------------------------------------------------------------------------
    def ping(self) -> Response:
        if self.service.is_ready and not self.is_draining():
            return Response(status=200)
        reason = "stopping" if self.is_draining() else (self.service.load_error or "loading")
        return json_response({"status": reason}, 503)

    def metrics(self) -> Response:
        return Response(metrics.render(), content_type=metrics.CONTENT_TYPE)

    def invocations(self) -> Response:
        body = read_json()
        schema = sniff_schema(body, self.service.engine.embeds_only)
        g.schema = schema
        if schema == "chat":
            body.pop("inputs", None)  # documented: messages wins when a body carries both
        sse = "text/event-stream" in request.headers.get("Accept", "")
        framing = "sse" if sse else self.service.settings.output_formatter
        return self.handlers[schema](body, framing)

    def chat_completions(self) -> Response:
        g.schema = "chat"
        return self._chat(read_json(), "sse")

    def completions(self) -> Response:
        g.schema = "completions"
        return self._completions(read_json(), "sse")

    def embeddings(self) -> Response:
        g.schema = "embeddings"
        return self._embeddings(read_json(), "json")

    def generate(self) -> Response:
        """TGI's ``/generate``: one input, one object."""
        g.schema = "legacy"  # errors in the legacy shape, an unreadable body's too
        return self._tgi(read_json(), stream=False)

    def generate_stream(self) -> Response:
        """TGI's ``/generate_stream``: one input, TGI's server-sent events."""
        g.schema = "legacy"
        return self._tgi(read_json(), stream=True)

    def tgi_root(self) -> Response:
        """TGI's ``POST /``: ``/generate`` or ``/generate_stream`` as the body's ``stream`` says."""
        g.schema = "legacy"
        body = read_json()
        return self._tgi(body, stream=body.get("stream") is True)

    def responses(self) -> Response:
        g.schema = "responses"
        return self._responses(read_json(), "sse")

    def stored_response(self, response_id: str) -> Response:
        g.schema = "responses"
        return json_response(self._stored(response_id).response)

    def delete_response(self, response_id: str) -> Response:
        g.schema = "responses"
        if not self.service.responses.delete(response_id):
            raise self._unknown_response(response_id, "response_id")
        return json_response(responses_format.deleted(response_id))

    def models(self) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    def model(self, model_id: str) -> Response:
        if model_id != self.service.model_name:
            raise NotFound(f"the model '{model_id}' does not exist; this server serves '{self.service.model_name}'",
                           param="model", code="model_not_found")
        return json_response(self._model_card())

    def tokenize(self) -> Response:
        """vLLM's ``/tokenize``: the tokenizer alone, on this thread (``protocol.tokenize``)."""
        return json_response(tokenize.tokenize(read_json(), self._renderer(), self.service.engine.limits.max_model_len))

    def detokenize(self) -> Response:
        return json_response(tokenize.detokenize(read_json(), self._renderer()))

    # ---- schemas ------------------------------------------------------------------------------------------
    def _chat(self, body: dict, framing: str) -> Response:
        parsed, extras = self._parse(ChatCompletionRequest, body)
        self._note(bool(parsed.stream), body.get("messages"))
        renderer = self._renderer(generates="messages")
        generation = extras.apply(intake.chat_request(parsed, renderer, self.service.defaults.temperature))
        generation = self._with_adapter([generation], parsed.model)[0]
        handle = self._submit(generation)
        plan = parsed.output_plan(renderer)
        ctx = self._context(ChatContext, generation.request_id, parsed.model, want_logprobs=parsed.logprobs,
                            include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                            keep_best=parsed.n if parsed.best_of and generation.beam is None else None,
                            tool_format=plan.tool_format, tool_calls_only=plan.calls_only,
                            reasoning_parser=renderer.reasoning_parser,
                            reasoning_opened=renderer.opens_reasoning(generation.prompt_ids))
        if not parsed.stream:
            try:
                return json_response(chat_format.chat_completion(handle, generation.n, ctx))
            finally:
                handle.cancel()  # when one choice failed, the others stop too
        records = chat_format.chat_chunks(handle, generation.n, ctx)
        return stream_response(records, framing, [handle],
                               lambda e: chat_format.error_record(e))

    def _tgi(self, body: dict, stream: bool) -> Response:
        if not isinstance(body.get("inputs"), str):
            raise BadRequest("TGI's routes take one input: a string", param="inputs")
        return self._legacy({**body, "stream": stream}, "tgi_sse", TGI_ROUTES_SHAPE)

    def _legacy_shape(self) -> LegacyShape:
        """On /invocations: TGI's spelling for TGI's client and under ``option.legacy_response=tgi``."""
        if self.service.settings.legacy_response == "tgi":
            return TGI_SAGEMAKER_SHAPE
        return TGI_ROUTES_SHAPE if TGI_CLIENT_AGENT in request.headers.get("User-Agent", "") else LMI_SHAPE

    def _legacy(self, body: dict, framing: str, shape: LegacyShape | None = None) -> Response:
        shape = shape or self._legacy_shape()
        parsed, extras = self._parse(LegacyRequest, body)
        self._note(bool(parsed.stream), body.get("inputs"))
        generations = self._with_adapter([extras.apply(generation) for generation in intake.legacy_requests(
            parsed, self._renderer(generates="inputs"), self.service.defaults.max_new_tokens)], None)
        handles = self._submit_all(generations)
        p = parsed.parameters
        ctx = self._context(LegacyContext, generations[0].request_id, None,
                            want_logprobs=p.details or p.decoder_input_details, want_prefill=p.decoder_input_details,
                            return_full_text=p.return_full_text, want_top_tokens=bool(p.top_n_tokens),
                            is_tgi=shape.is_tgi, seed=p.seed)
        if parsed.stream:
            records = legacy_format.generated_lines(handles[0], parsed.prompts[0], ctx)
            return stream_response(records, "tgi_sse" if shape.is_tgi else framing, handles,
                                   lambda e: legacy_format.error_line(e.message))
        try:
            pairs = zip(handles, parsed.prompts, strict=True)
            results = [legacy_format.generated(h, prompt, ctx) for h, prompt in pairs]
        finally:
            for handle in handles:  # when one prompt failed, the others stop too
                handle.cancel()
        # LMI answers a string input with one object; TGI and the HF LLM DLC with a one-element list
        return json_response(results[0] if not parsed.is_batch and shape.one_object else results)

    def _completions(self, body: dict, framing: str) -> Response:
        parsed, extras = self._parse(CompletionRequest, body)
        self._note(bool(parsed.stream), body.get("prompt"))
        renderer = self._renderer(generates="prompt")
        generations = self._with_adapter([extras.apply(generation) for generation in intake.completion_requests(
            parsed, renderer, self.service.defaults.temperature)], parsed.model)
        echoed = intake.echo_texts(parsed, renderer)
        handles = self._submit_all(generations)
        ctx = self._context(CompletionsContext, generations[0].request_id, parsed.model,
                            want_logprobs=parsed.logprobs is not None, num_logprobs=parsed.logprobs or 0,
                            include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
                            prompt_texts=echoed, return_full_text=parsed.echo,
                            is_echo_only=parsed.is_echo_only, num_prompt_logprobs=parsed.prompt_logprobs,
                            keep_best=parsed.n if parsed.best_of and generations[0].beam is None else None,
                            suffix=parsed.suffix or "")
        if parsed.stream:
            records = completions_format.completion_chunks(handles[0], generations[0].n, ctx)
            return stream_response(records, framing, handles, chat_format.error_record)
        try:
            return json_response(completions_format.completion(handles, generations[0].n, ctx))
        finally:
            for handle in handles:  # when one prompt failed, the others stop too
                handle.cancel()

    def _embeddings(self, body: dict, framing: str) -> Response:
        """Embeddings answer once (no stream): ``framing`` is the route's and unused."""
        parsed, _extras = self._parse(EmbeddingRequestBody, body)
        self._note(False, body.get("input"))
        embedding = intake.embedding_request(parsed, self._renderer(), g.request_id)
        result = self.service.engine.embed(embedding).result()
        size = len(result.vectors[0])
        if parsed.dimensions is not None and parsed.dimensions != size:
            raise BadRequest(f"this model's embeddings have {size} dimensions; it does not cut them to "
                             f"{parsed.dimensions}", param="dimensions")
        record = current_record()
        record.num_prompt_tokens = result.num_tokens
        return json_response(embeddings_format.embedding_list(result, parsed.model or self.service.model_name,
                                                              parsed.encoding_format))

    def _responses(self, body: dict, framing: str) -> Response:
        """OpenAI's Responses: converted into the chat request and served as chat is; formatted as a ``response``
        object or typed events; kept in this worker's store unless ``store`` is false."""
        parsed, extras = self._parse(ResponsesRequest, body)
        self._note(parsed.stream, body.get("input"))
        renderer = self._renderer(generates="input")
        history = self._conversation(parsed)
        generation, plan, fields = intake.responses_request(parsed, history, renderer,
                                                            self.service.defaults.temperature)
        try:
            handle = self._submit(extras.apply(generation))
        except ServingError as error:
            raise responses_error(error, fields) from None
        ctx = self._context(ResponsesContext, generation.request_id, parsed.model, echo=parsed.echo(),
                            tool_format=plan.tool_format, tool_calls_only=plan.calls_only,
                            reasoning_parser=renderer.reasoning_parser,
                            reasoning_opened=renderer.opens_reasoning(generation.prompt_ids))
        keep = (lambda result: self.service.responses.put(StoredResponse(result, tuple(history)))) \
            if parsed.store else (lambda result: None)
        if not parsed.stream:
            try:
                result = responses_format.response(handle, ctx)
            finally:
                handle.cancel()
            keep(result)
            return json_response(result)
        stream = responses_format.ResponseEvents(ctx)
        records = _keeping(stream.events(handle), keep)
        return stream_response(records, "typed_sse" if framing == "sse" else framing, [handle], stream.error_event)

    def _conversation(self, parsed: ResponsesRequest) -> list[dict]:
        """The items a request answers: the stored conversation it continues, then its own input."""
        if parsed.previous_response_id is None:
            return parsed.input_items()
        return self._stored(parsed.previous_response_id, "previous_response_id").conversation + parsed.input_items()

    def _stored(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self.service.responses.get(response_id)
        if stored is None:
            raise self._unknown_response(response_id, param)
        return stored

    def _unknown_response(self, response_id: str, param: str) -> NotFound:
        return NotFound(f"no response with id '{response_id}' is stored in this worker (responses are kept in the "
                        f"memory of the worker that answered them, the latest {self.service.responses.capacity})",
                        param=param, code="previous_response_not_found" if param == "previous_response_id"
                        else "response_not_found")

    # ---- helpers ------------------------------------------------------------------------------------------
    def _parse(self, model: type[Model], body: dict) -> tuple[Model, Extras]:
        """Validate the body under the request's ``extra-parameters`` policy; remember what it dropped."""
        policy = ExtraParameters.for_request(request.headers.get(EXTRA_PARAMETERS_HEADER),
                                             request.headers.get(CUSTOM_ATTRIBUTES_HEADER),
                                             self.service.settings.extra_parameters)
        parsed, extras = parse_request(model, body, policy)
        g.record.ignored_fields = tuple(extras.ignored)
        return parsed, extras

    def _model_card(self) -> dict:
        card = {"id": self.service.model_name, "object": "model", "created": self.created,
                "owned_by": "sagemaker-llm-container"}
        engine_path = self.service.engine_path
        return card if engine_path is None else {**card, "engine_path": engine_path}

    def _renderer(self, generates: str | None = None):
        """The prompt renderer; for a generation request (``generates``: its prompt field) refused first when the
        model serves embeddings only."""
        if generates is not None and self.service.engine.embeds_only:
            raise BadRequest("this model is an encoder: it serves embeddings only (POST /v1/embeddings, or a body "
                             "with input on /invocations), not generation", param=generates)
        if not self.service.serves_builtin:  # a user's model.py serves without the built-in engine
            raise NotFound(self.service.engine.reason, code="not_found")
        if self.is_draining():
            raise NotReady("the server is stopping")
        if self.service.renderer is None or not self.service.engine.is_ready:
            raise NotReady("the model is still loading")
        return self.service.renderer

    def _note(self, is_stream: bool, prompt: object) -> None:
        record = current_record()
        record.is_stream = is_stream
        if self.service.settings.log_prompts:
            record.prompt = prompt

    def _with_adapter(self, generations: list[GenerationRequest], model: str | None) -> list[GenerationRequest]:
        """The adapter a request picked: SageMaker's headers first, then the OpenAI ``model`` field when it names a
        registered adapter (vLLM's rule; any other name is the base model, as before adapters), else what the body's
        own fields said (legacy ``parameters.adapters`` / ``adapter_id``, already on each request)."""
        header = next((h for h in ADAPTER_HEADERS if request.headers.get(h)), None)
        if header is not None:
            name, param = request.headers[header], header
        elif model and model != self.service.model_name and model in self._adapter_names():
            name, param = model, "model"
        else:
            return generations
        return [dataclasses.replace(g, adapter=name, adapter_param=param) for g in generations]

    def _adapters(self) -> SharedAdapters | None:
        """The adapters, the same in every worker (a stand-in service without the attribute serves none)."""
        return getattr(self.service, "adapters", None)

    def _adapter_names(self) -> set[str]:
        store = self._adapters()
        return set() if store is None else {info.name for info in store.list()}

    def _submit(self, generation) -> ObservedHandle:
        store = self._adapters() if generation.adapter is not None else None
        if store is not None:
            store.sync()  # registered or removed by another worker since: the engine resolves from this worker's
        try:
            handle = self.service.engine.submit(generation)
        except Overloaded:
            metrics.record_rejection()
            raise
        finally:
            self._record_adapter_events()
        current_record().adapter = generation.adapter
        self._watch(handle)
        record = current_record()
        if not g.get("has_engine_id"):  # a legacy batch is known by its first prompt's id
            g.request_id = record.request_id = generation.request_id
            g.has_engine_id = True
        return ObservedHandle(handle, record)

    def _watch(self, handle) -> None:
        """Cancel ``handle`` as soon as the client's connection closes (not only when a write fails)."""
        sock = request.environ.get("gunicorn.socket")  # absent under a test client
        if sock is not None:
            g.setdefault("watch_keys", []).append(self.watcher.watch(sock, handle.cancel))

    def _submit_all(self, generations) -> list[ObservedHandle]:
        handles: list[ObservedHandle] = []
        try:
            for generation in generations:
                handles.append(self._submit(generation))
        except ServingError:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    def _context(self, kind: type[FormatContext], request_id: str, model: str | None, **options) -> FormatContext:
        renderer = self.service.renderer
        return kind(request_id=request_id, model=model or self.service.model_name, created=int(time.time()),
                    token_text=renderer.token_text, token_bytes=renderer.token_bytes, **options)

    # ---- adapters (SageMaker's LoRA contract) -----------------------------------------------------------------
    def register_adapter(self) -> Response:
        body, _extras = parse_request(RegisterAdapter, read_json(), ExtraParameters.ERROR)
        info = self._adapter_store().register(body.name, body.src, preload=body.preload, pin=body.pin)
        self._record_adapter_events()
        return json_response({"message": f"Adapter {body.name} registered", "adapter": _adapter_card(info)})

    def unregister_adapter(self, name: str) -> Response:
        self._adapter_store().unregister(name)
        return json_response({"message": f"Adapter {name} unregistered"})

    def list_adapters(self) -> Response:
        return json_response({"adapters": [_adapter_card(info) for info in self._adapter_store().list()]})

    def _adapter_store(self) -> SharedAdapters:
        if not self.service.engine.is_ready:
            raise NotReady("the model is still loading")
        store = self._adapters()
        if store is None:
            raise BadRequest("this server serves no LoRA adapters: start it with option.enable_lora=true "
                             "(OPTION_ENABLE_LORA=true)", param="option.enable_lora")
        return store

    def _record_adapter_events(self) -> None:
        store = self._adapters()
        for event, name in (() if store is None else store.drain_events()):
            metrics.record_adapter_event(name, event)

    # ---- errors -------------------------------------------------------------------------------------------
    def serving_error(self, error: ServingError) -> Response:
        if error.status_code >= 500:
            log.warning("request failed: %s", error.message)
        unmatched_legacy = request.url_rule is None and not request.path.startswith("/v1/")
        if g.get("schema") == "legacy" or unmatched_legacy:
            payload = {"error": error.message, "error_type": error.error_type, "param": error.param,
                       "code": error.status_code}
        else:
            payload = chat_format.error_record(error)
        return json_response(payload, error.status_code)

    def http_error(self, error: HTTPException) -> Response:
        if isinstance(error, RequestEntityTooLarge):
            return self.serving_error(PayloadTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes"))
        if isinstance(error, NoRoute):
            return self.serving_error(_no_route())
        wrapped = ServingError(error.description or error.name)
        if isinstance(error, MethodNotAllowed):
            wrapped = ServingError(f"method {request.method} is not allowed on {request.path}",
                                   code="method_not_allowed")
        wrapped.status_code, wrapped.error_type = error.code or 500, "invalid_request_error"
        response = self.serving_error(wrapped)
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            response.headers["Allow"] = ", ".join(sorted(error.valid_methods))
        return response

    def unexpected_error(self, error: Exception) -> Response:
        log.exception("unexpected error")
        return self.serving_error(EngineError(f"internal error ({type(error).__name__}); see the server log"))

    @staticmethod
    def start_record() -> None:
        g.request_id = new_request_id("req")
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        g.record = request_log.start(g.request_id, route)

    def finish_response(self, response: Response) -> Response:
        """Tag the response with its id; log and count the request once the response has been sent."""
        response.headers["X-Request-Id"] = g.get("request_id") or new_request_id("req")
        record = g.get("record")
        if record is not None and record.ignored_fields:
            response.headers[IGNORED_HEADER] = ",".join(quote(name, safe="._-[]") for name in record.ignored_fields)
        if record is not None and record.cut_by_deadline:  # a non-streaming answer the deadline cut (request_log)
            response.headers[TIMEOUT_HEADER] = f"{self.service.settings.request_timeout:g}"
        for key in g.get("watch_keys", ()):
            response.call_on_close(lambda key=key: self.watcher.unwatch(key))
        if record is not None and record.route not in UNLOGGED_ROUTES:
            record.schema = g.get("schema", "none")
            status = response.status_code
            response.call_on_close(lambda: request_log.finish(record, status))
        return response


def current_record() -> request_log.RequestRecord:
    """This request's record; a view called outside a routed request (a custom handler's start-up) gets a spare."""
    if g.get("record") is None:
        g.record = request_log.start(g.get("request_id") or new_request_id("req"), "/invocations")
    return g.record


def read_json() -> dict:
    raw = read_body()
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    try:  # JSON's "\ud800" escapes decode to lone surrogates: not text, and they break tokenizers and replies
        dumps(body).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the request body contains a lone UTF-16 surrogate (invalid Unicode)") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def read_body() -> bytes:
    """The body, up to ``MAX_BODY_BYTES`` (413 past it, chunked or not); 400 for broken chunked framing, 408 when
    it does not arrive within ``option.request_read_timeout``."""
    if request.content_length and request.content_length > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes")
    # gunicorn's wsgi.input ends where the body ends (Content-Length or chunked); werkzeug's wrapper would stop
    # silently at MAX_CONTENT_LENGTH. Read one byte past the limit, never more: a longer body is a 413.
    environ = request.environ
    stream = environ["wsgi.input"] if environ.get("wsgi.input_terminated") else request.stream
    parts, size = [], 0
    try:
        while size <= MAX_BODY_BYTES:
            part = stream.read(MAX_BODY_BYTES + 1 - size)
            if not part:
                break
            parts.append(part)
            size += len(part)
    except TimeoutError as error:  # the worker's deadline for the whole request (option.request_read_timeout)
        message = str(error) or "the request body did not arrive in time"
        raise RequestTimeout(message, code="request_timeout") from None
    except ParseException as error:  # gunicorn: a malformed chunk size, extension, terminator or trailer
        raise BadRequest(f"the request body's chunked framing is malformed: {type(error).__name__}: {error}",
                         code="bad_request") from None
    except OSError:  # the client closed the connection before the body ended
        raise BadRequest("the request body ended before it was complete") from None
    if size > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes")
    return b"".join(parts)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


# fields of a Responses request that an embeddings body does not have: any of them makes an ``input`` body a
# Responses request
_RESPONSES_ONLY = frozenset(ResponsesRequest.model_fields) - frozenset(EmbeddingRequestBody.model_fields)


def sniff_schema(body: dict, embeds_only: bool = False) -> str:
    if "messages" in body:
        return "chat"
    if "inputs" in body:
        return "legacy"
    if "prompt" in body:
        return "completions"
    if "input" in body:
        return "embeddings" if embeds_only or not is_responses_body(body) else "responses"
    raise BadRequest("the body has none of 'messages' (chat completions), 'inputs' (legacy schema), 'prompt' "
                     "(completions) and 'input' (Responses, or embeddings)", param="messages")


def is_responses_body(body: dict) -> bool:
    """``input`` with a field only Responses has (``instructions``, ``max_output_tokens``, ``stream``, ...), or an
    ``input`` list holding items (objects): a Responses request. ``input`` alone (text or token ids) stays the
    Databricks embeddings body it has always been here."""
    items = body.get("input")
    return bool(_RESPONSES_ONLY & body.keys()) or (isinstance(items, list) and any(isinstance(i, dict) for i in items))


def _keeping(records: Iterable[dict], keep: Callable[[dict], None]) -> Iterator[dict]:
    """Pass a Responses stream through, keeping the finished response when it ends (not a failed one)."""
    for record in records:
        if record["type"] in ("response.completed", "response.incomplete"):
            keep(record["response"])
        yield record


def _adapter_card(info: AdapterInfo) -> dict:
    return {"name": info.name, "src": info.src, "pinned": info.pinned, "loaded": info.loaded, "rank": info.rank,
            "target_modules": list(info.targets)}


def json_response(payload: object, status: int = 200) -> Response:
    return Response(dumps(payload), status=status, mimetype="application/json")


def stream_response(records: Iterable[dict], framing: str, handles: list[ObservedHandle],
                    error_record: Callable[[ServingError], dict]) -> Response:
    """Stream records in the chosen framing; a failure after the first byte becomes a final error record."""
    frame, mimetype = FRAMINGS[framing]

    def guarded() -> Iterator[dict]:
        try:
            yield from records
        except ServingError as error:
            yield error_record(error)
        except Exception as error:  # the status is already 200: say it in the stream instead
            log.exception("stream failed")
            yield error_record(EngineError(f"internal error ({type(error).__name__}); see the server log"))
        finally:
            for handle in handles:  # a client that went away frees its batch slots
                handle.cancel()

    headers = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"} if mimetype == SSE_MIMETYPE else {}
    return Response(frame(guarded()), mimetype=mimetype, headers=headers)
