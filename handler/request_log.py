"""Per-request observation: what one HTTP request did, measured where the client sees it.

A ``RequestRecord`` follows one HTTP request from arrival to its last byte (streams included); ``ObservedHandle``
wraps each engine handle the request reads, timing its tokens as the server consumes them (so time to first token
includes the wait for a batch slot). When the response closes, the record becomes one JSON line on stdout and the
request-level metrics. Prompt text is left out of the log unless ``option.log_prompts`` asks for it: prompts are the
customer's data.

May import: ``handler.errors``, ``metrics`` and the engine's interface (handles and events).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from handler import metrics
from handler.engine.backend import GenerationHandle
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest, TokenEvent
from handler.errors import GatewayTimeout

REQUEST_LOGGER = "handler.requests"
log = logging.getLogger(REQUEST_LOGGER)


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request's figures; times are ``time.monotonic()`` values."""

    request_id: str                                        # the engine's id once a request is submitted
    route: str
    started: float
    has_engine_id: bool = False                            # request_id is the engine's (a batch: its first prompt's)
    schema: str = "none"
    is_stream: bool = False
    prompt: object = None                                  # only when option.log_prompts
    ignored_fields: tuple[str, ...] = ()                   # body fields dropped under extra-parameters: ignore
    first_token_at: float | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    last_token_at: dict[tuple[int, int], float] = field(default_factory=dict)  # (handle, choice) -> time
    cut_by_deadline: bool = False                          # a choice ended at option.request_timeout with its text
    adapter: str | None = None                             # the LoRA adapter it generated with (None: the base)
    client_closed: bool = False                            # its client hung up first: its generations were cancelled

    def on_event(self, handle_key: int, event: TokenEvent, now: float) -> float | None:
        """Take one event; returns the gap since the same choice's previous token, if there was one."""
        gap = None
        if event.token_id is not None:
            key = (handle_key, event.index)
            previous = self.last_token_at.get(key)
            gap = None if previous is None else now - previous
            self.last_token_at[key] = now
            if self.first_token_at is None:
                self.first_token_at = now
        if event.finish_reason is not None:
            self.finish_reasons.append(event.finish_reason.value)
            self.num_completion_tokens += event.num_generated_tokens
        return gap

    def to_log(self, status: int, now: float) -> dict:
        ttft = None if self.first_token_at is None else round(self.first_token_at - self.started, 4)
        # pid: which gunicorn worker answered (with several, each has its own engine, batch and stored Responses)
        line = {"event": "request", "request_id": self.request_id, "pid": os.getpid(), "route": self.route,
                "schema": self.schema,
                "stream": self.is_stream, "status": status, "prompt_tokens": self.num_prompt_tokens,
                "completion_tokens": self.num_completion_tokens, "ttft_s": ttft,
                "total_s": round(now - self.started, 4), "finish_reason": self.finish_reason}
        if self.prompt is not None:
            line["prompt"] = self.prompt
        if self.ignored_fields:
            line["ignored_fields"] = list(self.ignored_fields)
        if self.adapter is not None:
            line["adapter"] = self.adapter
        if self.client_closed:
            line["cancelled"] = "client closed the connection"
        return line

    @property
    def finish_reason(self) -> str | None:
        """One reason when every choice agrees, else them all, comma-separated; None before any ended."""
        unique = list(dict.fromkeys(self.finish_reasons))
        return ",".join(unique) if unique else None


class ObservedHandle:
    """An engine handle as the server reads it: times tokens into the record; an engine timeout becomes a 504.

    A timeout before any token ends a non-streaming request with ``GatewayTimeout`` and a stream with its final error
    record, both through the server's usual error paths. A choice the deadline cut after tokens
    (``FinishReason.DEADLINE``) reaches the formatters as ``LENGTH``: its text so far, as when ``max_tokens`` cuts it;
    the record notes it (the log's finish reason ``deadline``, the timeout counter, and on a non-streaming response
    the ``X-Request-Timeout`` header).
    """

    def __init__(self, handle: GenerationHandle, record: RequestRecord) -> None:
        self._handle = handle
        self._record = record
        record.num_prompt_tokens += len(handle.request.prompt_ids)

    @property
    def request(self) -> GenerationRequest:
        return self._handle.request

    def cancel(self) -> None:
        self._handle.cancel()

    def __iter__(self) -> Iterator[TokenEvent]:
        num_finished = 0
        try:
            for event in self._handle:
                gap = self._record.on_event(id(self), event, time.monotonic())
                if gap is not None:
                    metrics.record_token_gap(gap)
                num_finished += event.finish_reason is not None
                if event.finish_reason is FinishReason.ERROR and event.error_kind is ErrorKind.TIMEOUT:
                    metrics.record_timeout()
                    raise GatewayTimeout(event.error)
                if event.finish_reason is FinishReason.DEADLINE:
                    if not self._record.cut_by_deadline:
                        metrics.record_timeout()
                    self._record.cut_by_deadline = True
                    event = replace(event, finish_reason=FinishReason.LENGTH)
                yield event
        finally:
            if num_finished == 0:  # the reader stopped first: the client went away, or another prompt failed
                self._record.finish_reasons.append(FinishReason.ABORT.value)


def start(request_id: str, route: str) -> RequestRecord:
    return RequestRecord(request_id, route, time.monotonic())


def finish(record: RequestRecord, status: int) -> None:
    """The response has been sent (or the client left): log the request and count it."""
    now = time.monotonic()
    if record.finish_reasons or record.first_token_at is not None:
        ttft = None if record.first_token_at is None else record.first_token_at - record.started
        metrics.record_generation(ttft, record.num_prompt_tokens, record.num_completion_tokens, now - record.started)
        if record.adapter is not None:
            metrics.record_adapter_request(record.adapter, record.num_completion_tokens)
    metrics.record_request(record.route, record.schema, status, now - record.started)  # last: "it is all in"
    log.info("request", extra={"fields": record.to_log(status, now)})


class JsonFormatter(logging.Formatter):
    """``{"time", "level", **fields}`` on one line; ``fields`` comes from the ``extra`` of the log call."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        fields = getattr(record, "fields", None) or {"message": record.getMessage()}
        return json.dumps({"time": stamp, "level": record.levelname, **fields}, ensure_ascii=False, default=str)


def configure_logging(level: str) -> None:
    """Set the process's log level, and send request lines as JSON to stdout (idempotent)."""
    logging.getLogger().setLevel(level.upper())
    if not any(isinstance(h.formatter, JsonFormatter) for h in log.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(JsonFormatter())
        log.addHandler(handler)
    log.propagate = False
