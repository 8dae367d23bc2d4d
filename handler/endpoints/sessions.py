"""SageMaker's stateful sessions: a ``{"requestType": ...}`` body on ``/invocations`` (``invocations.sniff_schema``
names it ``session``) opens or closes a session (``handler.sessions``, shared by the workers).

- ``{"requestType": "NEW_SESSION"}``: 200, ``X-Amzn-SageMaker-New-Session-Id: <uuid>; Expires=<ISO-8601>`` (a
  session header on it, boto3's ``SessionId="NEW_SESSION"``, is not read);
- ``{"requestType": "CLOSE"}`` with ``X-Amzn-SageMaker-Session-Id``: 200, ``X-Amzn-SageMaker-Closed-Session-Id``;
- 400: sessions off (``option.enable_stateful_sessions``), another ``requestType`` or any other field, a CLOSE
  without the header, or an id that is unknown, closed or expired.

A generation request carrying the header uses the session: ``Endpoint.submit`` looks it up (the same 400s) and hands
the engine its ``SessionRef``. Errors in the legacy shape (``{"error", "error_type", "param", "code"}``), as LMI's.
"""

from __future__ import annotations

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, json_response
from handler.errors import BadRequest, ErrorShape
from handler.protocol.common import parse_model
from handler.protocol.sessions import (
    CLOSED_SESSION_ID_HEADER,
    NEW_SESSION_ID_HEADER,
    SESSION_ID_HEADER,
    RequestType,
    SessionRequest,
)


class Sessions(Endpoint):
    shape = ErrorShape.LEGACY
    schema = "session"

    @answers
    def serve(self, call: Call, body: dict, framing: str) -> Response:
        store = self.sessions("requestType")
        parsed = parse_model(SessionRequest, body)
        if parsed.requestType is RequestType.NEW_SESSION:
            session = store.create()
            response = json_response({"message": f"Session {session.session_id} created",
                                      "session_id": session.session_id, "expires": session.expires})
            response.headers[NEW_SESSION_ID_HEADER] = f"{session.session_id}; Expires={session.expires}"
            return response
        session_id = call.headers.get(SESSION_ID_HEADER)
        if not session_id:
            raise BadRequest(f"a CLOSE request names its session in {SESSION_ID_HEADER}", param=SESSION_ID_HEADER)
        store.close(session_id)
        response = json_response({"message": f"Session {session_id} closed", "session_id": session_id})
        response.headers[CLOSED_SESSION_ID_HEADER] = session_id
        return response
