"""The bodies and headers of SageMaker's stateful sessions on ``/invocations`` (``model-hosting-container-standards``'
``SessionRequest`` and ``SageMakerSessionHeader``, validated here because that package is FastAPI's and this server
is Flask): ``{"requestType": "NEW_SESSION"}`` or ``{"requestType": "CLOSE"}``, nothing else in the body."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict

SESSION_ID_HEADER = "X-Amzn-SageMaker-Session-Id"                # a request's session (boto3's SessionId)
NEW_SESSION_ID_HEADER = "X-Amzn-SageMaker-New-Session-Id"        # "<id>; Expires=<ISO-8601>", on NEW_SESSION's answer
CLOSED_SESSION_ID_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"  # "<id>", on CLOSE's answer
# The standards package's words when sessions are off (its tests look for them)
SESSIONS_DISABLED = "Invalid payload. stateful sessions not enabled"


class RequestType(enum.Enum):
    NEW_SESSION = "NEW_SESSION"
    CLOSE = "CLOSE"


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requestType: RequestType  # noqa: N815 (SageMaker's name)
