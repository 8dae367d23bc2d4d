"""The probes: SageMaker's ``GET /ping`` (200 with an empty body once the model is loaded and the server is not
stopping, else 503 saying why; it never waits on the model) and Prometheus' ``GET /metrics`` (every worker's
figures, from the multiprocess files)."""

from __future__ import annotations

from flask import Response

from handler import metrics
from handler.endpoints.base import Call, Endpoint, answers, json_response


class Health(Endpoint):
    @answers
    def ping(self, call: Call) -> Response:
        if self.service.is_ready and not self.door.is_draining():
            return Response(status=200)
        reason = "stopping" if self.door.is_draining() else (self.service.load_error or "loading")
        return json_response({"status": reason}, 503)

    @answers
    def metrics(self, call: Call) -> Response:
        return Response(metrics.render(), content_type=metrics.CONTENT_TYPE)
