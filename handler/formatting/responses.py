"""Token events -> OpenAI's Responses API: one ``response`` object, or the typed stream events that build it.

The shapes are the openai SDK's pydantic models (``openai.types.responses``), which clients parse into: a
``message`` item with one ``output_text`` part, then one ``function_call`` item per tool call parsed out of the
text. A stream opens with ``response.created`` and ``response.in_progress``, adds each item as it begins
(``output_item.added``, ``content_part.added``), sends text as ``output_text.delta`` and each call's arguments
whole as one ``function_call_arguments.delta``, closes each item (``.done`` events), and ends with
``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut it, or ``response.failed``).
Every event carries its ``sequence_number``, from 0.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator

from handler.engine.types import FinishReason, TokenEvent
from handler.errors import EngineError, ServingError
from handler.formatting.context import ResponsesContext, failure, fold
from handler.prompt import tool_calls


def new_item_id(prefix: str) -> str:
    """OpenAI's id style: ``msg_…``, ``fc_…``, ``resp_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(ctx: ResponsesContext, status: str, output: list[dict], usage: dict | None = None,
                    incomplete: bool = False, error: dict | None = None) -> dict:
    """The ``response`` object; the request's own fields come from ``ctx.echo``."""
    return {"id": ctx.request_id, "object": "response", "created_at": ctx.created, "status": status,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": ctx.model, "output": output, "usage": usage, **ctx.echo}


def response_usage(final: TokenEvent) -> dict:
    """Usage with the detail objects the SDK requires (nothing here is cached or reasoned separately)."""
    return {"input_tokens": final.num_prompt_tokens, "output_tokens": final.num_generated_tokens,
            "total_tokens": final.num_prompt_tokens + final.num_generated_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: tool_calls.ToolCall, arguments: str | None = None) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress"}


def response(events: Iterable[TokenEvent], ctx: ResponsesContext) -> dict:
    """Fold one request's events into the ``response`` object (a failure raises, as for chat)."""
    choice = fold(events, 1)[0]
    incomplete = choice.finish.finish_reason is FinishReason.LENGTH
    content, calls = choice.text, []
    if ctx.tool_format is not None:
        parsed = tool_calls.parse_tool_calls(choice.text, ctx.tool_format, calls_only=ctx.tool_calls_only)
        content, calls = parsed.content, parsed.calls
    output = []
    if content or not calls:
        output.append(message_item(new_item_id("msg"), content or "", "incomplete" if incomplete else "completed"))
    output += [call_item(new_item_id("fc"), call) for call in calls]
    status = "incomplete" if incomplete else "completed"
    return response_object(ctx, status, output, response_usage(choice.finish), incomplete)


class ResponseEvents:
    """One streamed response: turns token events into typed events, numbering them; ``error_event`` ends a stream
    that failed outside the events (the server's guard calls it)."""

    def __init__(self, ctx: ResponsesContext) -> None:
        self.ctx = ctx
        self._sequence = 0
        self._output: list[dict] = []
        self._message: dict | None = None  # the open message item, while its text streams
        self._parser = tool_calls.ToolCallStream(ctx.tool_format, calls_only=ctx.tool_calls_only) \
            if ctx.tool_format else None

    def _event(self, kind: str, **fields) -> dict:
        record = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return record

    def events(self, token_events: Iterable[TokenEvent]) -> Iterator[dict]:
        yield self._event("response.created", response=response_object(self.ctx, "in_progress", []))
        yield self._event("response.in_progress", response=response_object(self.ctx, "in_progress", []))
        for event in token_events:
            error = failure(event)
            if error is not None:
                yield self.error_event(error)
                return
            for delta in self._deltas(event.text, is_last=event.finish_reason is not None):
                if isinstance(delta, tool_calls.CallDelta):
                    yield from self._close_message("completed")
                    yield from self._call(delta.call)
                elif delta.text:
                    yield from self._text(delta.text)
            if event.finish_reason is not None:
                yield from self._finish(event)

    def _deltas(self, text: str, *, is_last: bool) -> list[tool_calls.Delta]:
        if self._parser is None:
            return [tool_calls.ContentDelta(text)]
        return self._parser.push(text) + (self._parser.finish() if is_last else [])

    def _finish(self, final: TokenEvent) -> Iterator[dict]:
        incomplete = final.finish_reason is FinishReason.LENGTH
        if not self._output and self._message is None:  # nothing was said: one empty message, as folded
            yield from self._open_message()
        yield from self._close_message("incomplete" if incomplete else "completed")
        status = "incomplete" if incomplete else "completed"
        done = response_object(self.ctx, status, self._output, response_usage(final), incomplete)
        yield self._event(f"response.{status}", response=done)

    def _open_message(self) -> Iterator[dict]:
        self._message = message_item(new_item_id("msg"), None, "in_progress")
        index = len(self._output)
        yield self._event("response.output_item.added", output_index=index, item=self._message)
        yield self._event("response.content_part.added", output_index=index, item_id=self._message["id"],
                          content_index=0, part=text_part(""))
        self._message = message_item(self._message["id"], "", "in_progress")

    def _text(self, text: str) -> Iterator[dict]:
        if self._message is None:
            yield from self._open_message()
        self._message["content"][0]["text"] += text
        yield self._event("response.output_text.delta", output_index=len(self._output),
                          item_id=self._message["id"], content_index=0, delta=text, logprobs=[])

    def _close_message(self, status: str) -> Iterator[dict]:
        if self._message is None:
            return
        item, index, text = self._message, len(self._output), self._message["content"][0]["text"]
        yield self._event("response.output_text.done", output_index=index, item_id=item["id"], content_index=0,
                          text=text, logprobs=[])
        yield self._event("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                          part=text_part(text))
        item = message_item(item["id"], text, status)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)
        self._message = None

    def _call(self, call: tool_calls.ToolCall) -> Iterator[dict]:
        item_id, index = new_item_id("fc"), len(self._output)
        yield self._event("response.output_item.added", output_index=index, item=call_item(item_id, call, ""))
        yield self._event("response.function_call_arguments.delta", output_index=index, item_id=item_id,
                          delta=call.arguments)
        yield self._event("response.function_call_arguments.done", output_index=index, item_id=item_id,
                          arguments=call.arguments)
        item = call_item(item_id, call)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)

    def error_event(self, error: ServingError) -> dict:
        """``response.failed``: the response so far, its status ``failed`` and the error."""
        if not isinstance(error, ServingError):
            error = EngineError(str(error))
        code = "rate_limit_exceeded" if error.status_code == 429 else "server_error"
        failed = response_object(self.ctx, "failed", self._output, error={"code": code, "message": error.message})
        return self._event("response.failed", response=failed)


def deleted(response_id: str) -> dict:
    """The answer to ``DELETE /v1/responses/{id}``."""
    return {"id": response_id, "object": "response.deleted", "deleted": True}
