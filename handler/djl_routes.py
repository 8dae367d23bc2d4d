"""Flask glue for the djl-style contract (handler/djl.py): /invocations through the user's ``handle``."""

from __future__ import annotations

import logging
from collections.abc import Callable

from flask import Flask, Response, request

from handler.djl import Input, Output, set_builtin
from handler.errors import EngineError, ServingError

log = logging.getLogger(__name__)
_MAX_MESSAGE_CHARS = 300


def install_user_handler(app: Flask, builtin_view, service, read_body: Callable[[], bytes]) -> None:
    """Route /invocations to the user's handler; let it call the built-in view through ``builtin_handle``.
    ``read_body`` reads the request body under the server's limits (413, 400, 408 as JSON errors)."""
    handler = service.user_handler
    properties = service.handler_properties

    def user_invocations() -> Response:
        inputs = Input(read_body(), request.content_type or "", dict(request.headers), properties)
        try:
            output = handler(inputs)
        except ServingError:
            raise  # a built-in error the handler let through keeps its status and shape
        except Exception as error:
            log.exception("custom handler %s failed", handler.name)
            message = f"{type(error).__name__}: {error}"[:_MAX_MESSAGE_CHARS]
            raise EngineError(f"the custom handler {handler.name} failed: {message}") from None
        return Response(output.iter_body(), status=output.code, headers=output.properties)

    def run_builtin(inputs: Input) -> Output:
        headers = {k: v for k, v in inputs.headers.items() if k.lower() not in ("content-length", "host")}
        with app.test_request_context("/invocations", method="POST", data=inputs.get_as_bytes(), headers=headers,
                                      content_type=inputs.content_type or "application/json"):
            try:
                response = builtin_view()
            except Exception as error:
                response = app.handle_user_exception(error)
        output = Output(code=response.status_code)
        for key, value in response.headers.items():
            if key.lower() not in ("content-length",):
                output.add_property(key, value)
        if response.is_streamed:
            return output.add_stream_content(response.response, response.mimetype)
        return output.add(response.get_data())

    app.view_functions["invocations"] = user_invocations
    set_builtin(run_builtin)
