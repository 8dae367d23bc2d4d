"""The real engine thread (scripted runner of ``test_backpressure``): a request's deadline counts from when it
arrived (``GenerationRequest.arrived_at``, stamped before its prompt and images were rendered), not from submit, so
the time its images took to fetch and encode is part of ``option.request_timeout``."""

from __future__ import annotations

import time

from handler.engine.backend import Admission
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest, StopConditions
from tests.integration.test_backpressure import Harness, finals, tokenizer  # noqa: F401 (tokenizer: a fixture)

SHORT = StopConditions(max_new_tokens=2, ignore_eos=True)


def test_the_deadline_counts_from_arrival_when_the_request_carries_it(tokenizer) -> None:  # noqa: F811
    h = Harness(tokenizer, Admission(timeout_s=30)).start()
    try:
        late = h.engine.submit(GenerationRequest("late", (1, 2, 3), stop=SHORT, arrived_at=time.monotonic() - 31))
        [event] = finals(late)
        assert event.finish_reason is FinishReason.ERROR and event.error_kind is ErrorKind.TIMEOUT
        assert event.error == "request timed out after 30 s (option.request_timeout)"
        fresh = h.engine.submit(GenerationRequest("fresh", (1, 2, 3), stop=SHORT, arrived_at=time.monotonic() - 5))
        assert [e.finish_reason for e in finals(fresh)] == [FinishReason.LENGTH]
        plain = h.engine.submit(GenerationRequest("plain", (1, 2, 3), stop=SHORT))  # no arrival: from submit
        assert [e.finish_reason for e in finals(plain)] == [FinishReason.LENGTH]
    finally:
        h.runner.open_gate()
        h.engine.stop()
