"""``/invocations`` through a user's handler (djl-python's contract), and the built-in handler it may call.

``UserInvocations`` answers ``/invocations`` with the user's ``handle``: the request as an ``Input`` (its body,
content type and headers, and the server's settings as properties), the ``Output`` as the response. An error inside
the handler is a 500 naming it, without a traceback; the worker keeps serving.

``builtin_handle`` reaches the built-in ``/invocations`` endpoint directly: the ``Input`` becomes a ``Call`` (its
headers, its body under the server's limit) and the endpoint's response an ``Output``. Called while the handler
answers a request (on its thread, or in its ``async def handle``'s task), the built-in call is logged and counted as
part of that request; called outside one (at initialisation, from a thread of the handler's own), it has a record
of its own.

May import: ``handler.djl``, the endpoints' base and body, ``request_log``, ``handler.errors``.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from flask import Response
from werkzeug.datastructures import Headers

from handler import request_log
from handler.djl.builtin import bind
from handler.djl.types import Input, Output
from handler.endpoints.base import Call, Endpoint, FrontDoor, answers
from handler.endpoints.body import bounded
from handler.errors import EngineError, ServingError
from handler.protocol.common import new_request_id

log = logging.getLogger(__name__)
_MAX_MESSAGE_CHARS = 300
# The request a user's handle is answering: set around the call, so the built-in calls it makes share its record
# (a context variable: it follows the call into its thread's context and an ``async def handle``'s task).
_answering: ContextVar[Call | None] = ContextVar("answering", default=None)


class UserInvocations(Endpoint):
    def __init__(self, door: FrontDoor, builtin: Endpoint) -> None:
        """``builtin``: the built-in ``/invocations`` endpoint (its ``post`` answers a ``Call``)."""
        super().__init__(door)
        self.handler = door.service.user_handler
        self.builtin = builtin
        bind(self.run_builtin)

    @answers
    def post(self, call: Call) -> Response:
        inputs = Input(call.read_body(), call.headers.get("Content-Type") or "", dict(call.headers),
                       self.service.handler_properties)
        token = _answering.set(call)
        try:
            output = self.handler(inputs)
        except ServingError:
            raise  # a built-in error the handler let through keeps its status and shape
        except Exception as error:
            log.exception("custom handler %s failed", self.handler.name)
            message = f"{type(error).__name__}: {error}"[:_MAX_MESSAGE_CHARS]
            raise EngineError(f"the custom handler {self.handler.name} failed: {message}") from None
        finally:
            _answering.reset(token)
        return Response(output.iter_body(), status=output.code, headers=output.properties)

    def run_builtin(self, inputs: Input) -> Output:
        """``builtin_handle``: ``inputs`` answered by the built-in ``/invocations`` endpoint."""
        raw = inputs.get_as_bytes()
        answering = _answering.get()
        record = answering.record if answering is not None else request_log.start(new_request_id("req"),
                                                                                   "/invocations")
        limit = self.service.settings.max_request_size
        response = self.builtin.post(Call(Headers(inputs.headers), lambda: bounded(raw, limit), record))
        output = Output(code=response.status_code)
        for key, value in response.headers.items():
            if key.lower() != "content-length":
                output.add_property(key, value)
        if response.is_streamed:
            return output.add_stream_content(response.response, response.mimetype)
        return output.add(response.get_data())
