"""The legacy schema (LMI and TGI): ``{"inputs", "parameters", "stream"}`` on ``/invocations``, and TGI's own routes
(``POST /generate``, ``/generate_stream``, ``POST /``).

An answer is spelled as LMI's or as TGI's (``LegacyForm``), decided once per request: TGI's on TGI's routes, under
``option.legacy_response=tgi``, and for TGI's own client (``huggingface_hub``'s ``InferenceClient``, known by its
User-Agent), which reads only server-sent events. The form gives the formatter its names (``LegacyContext.is_tgi``),
a stream its framing (TGI's server-sent events) and its last line when it fails, and a single input its answer (one
object, or a one-element list). Errors in the legacy shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, arrival, json_response, stream_response
from handler.errors import BadRequest, ErrorShape, error_record
from handler.formatting.legacy import LegacyContext, generated, generated_lines
from handler.protocol.legacy import LegacyRequest


@dataclass(frozen=True, slots=True)
class LegacyForm:
    """How a legacy-schema answer is spelled."""

    is_tgi: bool        # TGI's names (formatting.legacy) and TGI's server-sent events when streaming
    one_object: bool    # a string input is answered with one object (LMI, TGI's /generate), not a one-element list

    def framing(self, asked: str) -> str:
        """The stream's framing: TGI's server-sent events in TGI's spelling, else the one asked for."""
        return "tgi_sse" if self.is_tgi else asked


LMI = LegacyForm(is_tgi=False, one_object=True)
TGI_SAGEMAKER = LegacyForm(is_tgi=True, one_object=False)   # TGI's /invocations, the HF LLM DLC
TGI_ROUTES = LegacyForm(is_tgi=True, one_object=True)       # TGI's /generate, /generate_stream, POST /
# huggingface_hub's User-Agent ("...; hf_hub/2.4.0; ..."). Its InferenceClient reads only "data:" lines and sends
# "Accept: */*", as python-requests does (and JSON-lines callers with it), so the Accept header cannot tell it apart.
# SageMaker does not forward a caller's User-Agent, so nothing behind InvokeEndpoint is affected.
TGI_CLIENT_AGENT = "hf_hub/"


class Legacy(Endpoint):
    shape = ErrorShape.LEGACY
    schema = "legacy"

    @answers
    def generate(self, call: Call) -> Response:
        """TGI's ``/generate``: one input, one object."""
        return self._tgi(call, call.json(), stream=False)

    @answers
    def generate_stream(self, call: Call) -> Response:
        """TGI's ``/generate_stream``: one input, TGI's server-sent events."""
        return self._tgi(call, call.json(), stream=True)

    @answers
    def tgi_root(self, call: Call) -> Response:
        """TGI's ``POST /``: ``/generate`` or ``/generate_stream`` as the body's ``stream`` says."""
        body = call.json()
        return self._tgi(call, body, stream=body.get("stream") is True)

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        """A legacy body on ``/invocations``: TGI's spelling for TGI's client and under
        ``option.legacy_response=tgi``, else LMI's."""
        if self.service.settings.legacy_response == "tgi":
            form = TGI_SAGEMAKER
        else:
            form = TGI_ROUTES if TGI_CLIENT_AGENT in call.headers.get("User-Agent", "") else LMI
        return self._answer(call, body, framing, form)

    def _tgi(self, call: Call, body: dict, stream: bool) -> Response:
        if not isinstance(body.get("inputs"), str):
            raise BadRequest("TGI's routes take one input: a string", param="inputs")
        return self._answer(call, {**body, "stream": stream}, "sse", TGI_ROUTES)

    def _answer(self, call: Call, body: dict, framing: str, form: LegacyForm) -> Response:
        parsed, extras = self.parse(call, LegacyRequest, body)
        self.note(call, parsed.stream, body.get("inputs"))
        prepared = parsed.prepare(self.renderer(generates="inputs"), self.service.defaults.max_new_tokens, arrival())
        generations = self.with_adapter(call, [extras.apply(generation) for generation in prepared], None)
        handles = self.submit_all(call, generations)
        p = parsed.parameters
        ctx = self.context(LegacyContext, generations[0].request_id, None,
                           want_logprobs=p.details or p.decoder_input_details, want_prefill=p.decoder_input_details,
                           return_full_text=p.return_full_text, want_top_tokens=bool(p.top_n_tokens),
                           is_tgi=form.is_tgi, seed=p.seed)
        if parsed.stream:
            records = generated_lines(handles[0], parsed.prompts[0], ctx)
            return stream_response(records, form.framing(framing), handles,
                                   lambda error: error_record(error, ctx.error_shape))
        try:
            pairs = zip(handles, parsed.prompts, strict=True)
            results = [generated(h, prompt, ctx) for h, prompt in pairs]
        finally:
            for handle in handles:  # when one prompt failed, the others stop too
                handle.cancel()
        # LMI answers a string input with one object; TGI and the HF LLM DLC with a one-element list
        return json_response(results[0] if not parsed.is_batch and form.one_object else results)
