"""Token events -> OpenAI's Responses API: one ``response`` object, or the typed stream events that build it.

The shapes are the openai SDK's pydantic models (``openai.types.responses``), which clients parse into: a
``message`` item with one ``output_text`` part, then one ``function_call`` item per tool call parsed out of the
text. A stream opens with ``response.created`` and ``response.in_progress``, adds each item as it begins
(``output_item.added``, ``content_part.added``), sends text as ``output_text.delta`` and each call's arguments
whole as one ``function_call_arguments.delta``, closes each item (``.done`` events), and ends with
``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut it, or ``response.failed``).
Every event carries its ``sequence_number``, from 0.

With a reasoning model (``ResponsesContext.reasoning_parser``, as on chat) the text is split first
(``parsing.reasoning``): the reasoning becomes a ``reasoning`` item before the answer (one ``reasoning_text``
part, streamed as ``reasoning_text.delta``), the answer the message, harmony's commentary calls function calls;
``output_tokens_details.reasoning_tokens`` counts the tokens generated while the reasoning was open.

What a request includes: ``seal`` (``include: ["reasoning.encrypted_content"]``) gives each finished reasoning item
its text sealed as ``encrypted_content``; ``want_logprobs`` (``message.output_text.logprobs``) gives the message's
``output_text`` the logprobs of the answer's tokens (those generated after the reasoning), each delta those of the
tokens since the previous one. A call to a namespaced function (``namespaced``: offered name -> namespace and own
name) comes back under its own name with its ``namespace``. A background response (``queued``) is created ``queued``
and is ``in_progress`` from its first token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from handler.engine.types import FinishReason, TokenEvent
from handler.errors import EngineError, ServingError
from handler.formatting.chat import split_choice, token_logprob
from handler.formatting.context import FormatContext, failure, fold
from handler.parsing import reasoning
from handler.parsing.dialects import ToolCall
from handler.parsing.tool_stream import CallDelta, ContentDelta, Delta, ToolCallStream, parse_tool_calls


@dataclass(frozen=True, slots=True)
class ResponsesContext(FormatContext):
    echo: dict = field(default_factory=dict)  # the request fields the response object repeats (protocol's echo())
    tool_format: str | None = None       # parse tool calls in this format (None: the text is all content)
    tool_calls_only: bool = False        # a forced call, so no content (a call cut by max_output_tokens is dropped)
    reasoning_parser: str | None = None  # split reasoning into a reasoning item (parsing.reasoning)
    reasoning_opened: bool = False       # the prompt opened the reasoning: the output starts inside it
    want_logprobs: bool = False          # include message.output_text.logprobs
    seal: Callable[[str], str] | None = None   # include reasoning.encrypted_content: seals a reasoning item's text
    namespaced: dict = field(default_factory=dict)  # offered function name -> (namespace, its own name)
    queued: bool = False                 # a background response: created queued, in progress from its first token


def new_item_id(prefix: str) -> str:
    """OpenAI's id style: ``msg_…``, ``fc_…``, ``resp_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(ctx: ResponsesContext, status: str, output: list[dict], usage: dict | None = None,
                    incomplete: bool = False, error: dict | None = None) -> dict:
    """The ``response`` object; the request's own fields come from ``ctx.echo``."""
    return {"id": ctx.request_id, "object": "response", "created_at": ctx.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": ctx.model, "output": output, "usage": usage, **ctx.echo}


def response_usage(final: TokenEvent, reasoning_tokens: int = 0) -> dict:
    """Usage with the detail objects the SDK requires (nothing here is counted as cached)."""
    return {"input_tokens": final.num_prompt_tokens, "output_tokens": final.num_generated_tokens,
            "total_tokens": final.num_prompt_tokens + final.num_generated_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, status: str, logprobs: list[dict] | None = None) -> dict:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str, ctx: ResponsesContext | None = None) -> dict:
    """A reasoning item; finished (``ctx`` given), with its text sealed when the request included it. No summary
    is written: ``summary`` is empty, as OpenAI's schema allows."""
    content = [] if text is None else [reasoning_part(text)]
    item = {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    if ctx is not None and ctx.seal is not None and text is not None:
        item["encrypted_content"] = ctx.seal(text)
    return item


def call_item(item_id: str, call: ToolCall, ctx: ResponsesContext, arguments: str | None = None) -> dict:
    """A function call item, under the function's own name and its namespace when it is a namespaced one."""
    namespace, name = ctx.namespaced.get(call.name, (None, call.name))
    item = {"id": item_id, "type": "function_call", "call_id": call.id, "name": name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress"}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def answer_logprobs(events: Iterable[TokenEvent], ctx: ResponsesContext) -> list[dict]:
    """The logprobs of the answer's tokens: every token after the reasoning (all of them without a reasoning
    model), special tokens left out."""
    splitter = reasoning.splitter(ctx.reasoning_parser, ctx.reasoning_opened) if ctx.reasoning_parser else None
    entries = []
    for event in events:
        reasoned = splitter is not None and splitter.in_reasoning
        if splitter is not None:
            splitter.push(event.text)
            reasoned = reasoned or splitter.in_reasoning  # the token that opened it (<think>) is reasoning's too
        if not reasoned and event.token_id is not None and not event.is_special:
            entries.append(token_logprob(event, ctx))
    return entries


def response(events: Iterable[TokenEvent], ctx: ResponsesContext) -> dict:
    """Fold one request's events into the ``response`` object (a failure raises, as for chat)."""
    choice = fold(events, 1)[0]
    incomplete = choice.finish.finish_reason is FinishReason.LENGTH
    status = "incomplete" if incomplete else "completed"
    output, content, calls, reasoning_tokens = [], choice.text, [], 0
    if ctx.reasoning_parser:
        split = split_choice(choice, ctx)
        content, calls, reasoning_tokens = split.content, list(split.calls), split.num_reasoning_tokens
        if split.reasoning:
            cut = incomplete and split.in_reasoning
            output.append(reasoning_item(new_item_id("rs"), split.reasoning, "incomplete" if cut else "completed",
                                         ctx))
    if ctx.tool_format is not None:
        parsed = parse_tool_calls(content, ctx.tool_format, calls_only=ctx.tool_calls_only)
        content, calls = parsed.content, calls + parsed.calls
    if content or not (calls or output):
        logprobs = answer_logprobs(choice.events, ctx) if ctx.want_logprobs else None
        output.append(message_item(new_item_id("msg"), content or "", status, logprobs))
    output += [call_item(new_item_id("fc"), call, ctx) for call in calls]
    return response_object(ctx, status, output, response_usage(choice.finish, reasoning_tokens), incomplete)


class ResponseEvents:
    """One streamed response: turns token events into typed events, numbering them; ``error_event`` ends a stream
    that failed outside the events (the server's guard calls it)."""

    def __init__(self, ctx: ResponsesContext) -> None:
        self.ctx = ctx
        self._sequence = 0
        self._output: list[dict] = []
        self._message: dict | None = None  # the open message item, while its text streams
        self._parser = ToolCallStream(ctx.tool_format, calls_only=ctx.tool_calls_only) \
            if ctx.tool_format else None
        self._splitter = reasoning.splitter(ctx.reasoning_parser, ctx.reasoning_opened) \
            if ctx.reasoning_parser else None
        self._reasoning: dict | None = None  # the open reasoning item, while its text streams
        self._num_reasoning_tokens = 0
        self._pending_logprobs: list[dict] = []   # the answer's tokens since the last text delta
        self._message_logprobs: list[dict] = []   # the open message's tokens

    def _event(self, kind: str, **fields) -> dict:
        record = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return record

    def events(self, token_events: Iterable[TokenEvent]) -> Iterator[dict]:
        queued = self.ctx.queued
        yield self._event("response.created", response=response_object(self.ctx, "queued" if queued else
                                                                       "in_progress", []))
        if not queued:
            yield self._event("response.in_progress", response=response_object(self.ctx, "in_progress", []))
        for event in token_events:
            if queued:  # its first token: the engine took it
                queued = False
                yield self._event("response.in_progress", response=response_object(self.ctx, "in_progress", []))
            error = failure(event)
            if error is not None:
                yield self.error_event(error)
                return
            is_last = event.finish_reason is not None
            for piece in self._pieces(event):
                if piece.kind == reasoning.REASONING:
                    yield from self._reason(piece.text)
                elif piece.kind == reasoning.TOOL_CALL:
                    yield from self._close_reasoning("completed")
                    yield from self._close_message("completed")
                    yield from self._call(ToolCall(piece.name or "", piece.text))
                else:
                    yield from self._content(piece.text, is_last=False)
            if is_last:
                yield from self._content("", is_last=True)
                yield from self._finish(event)

    def _pieces(self, event: TokenEvent) -> list[reasoning.Piece]:
        """The event's text, split into reasoning and answer when the model reasons."""
        if self._splitter is None:
            self._note_logprob(event, reasoned=False)
            return [reasoning.Piece(reasoning.CONTENT, event.text)]
        reasoned = self._splitter.in_reasoning
        self._num_reasoning_tokens += reasoned and event.token_id is not None
        pieces = self._splitter.push(event.text)
        self._note_logprob(event, reasoned=reasoned or self._splitter.in_reasoning)
        return pieces + (self._splitter.finish() if event.finish_reason is not None else [])

    def _note_logprob(self, event: TokenEvent, *, reasoned: bool) -> None:
        """An answer token's logprob, for the next text delta (``answer_logprobs``' rule)."""
        if self.ctx.want_logprobs and not reasoned and event.token_id is not None and not event.is_special:
            self._pending_logprobs.append(token_logprob(event, self.ctx))

    def _content(self, text: str, *, is_last: bool) -> Iterator[dict]:
        for delta in self._deltas(text, is_last=is_last):
            if isinstance(delta, CallDelta):
                yield from self._close_reasoning("completed")
                yield from self._close_message("completed")
                yield from self._call(delta.call)
            elif delta.text:
                yield from self._close_reasoning("completed")
                yield from self._text(delta.text)

    def _deltas(self, text: str, *, is_last: bool) -> list[Delta]:
        if self._parser is None:
            return [ContentDelta(text)]
        return self._parser.push(text) + (self._parser.finish() if is_last else [])

    def _finish(self, final: TokenEvent) -> Iterator[dict]:
        incomplete = final.finish_reason is FinishReason.LENGTH
        status = "incomplete" if incomplete else "completed"
        yield from self._close_reasoning(status)  # still open: cut inside the reasoning
        if not self._output and self._message is None:  # nothing was said: one empty message, as folded
            yield from self._open_message()
        yield from self._close_message(status)
        usage = response_usage(final, self._num_reasoning_tokens)
        done = response_object(self.ctx, status, self._output, usage, incomplete)
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
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        self._message_logprobs += logprobs
        yield self._event("response.output_text.delta", output_index=len(self._output),
                          item_id=self._message["id"], content_index=0, delta=text, logprobs=logprobs)

    def _close_message(self, status: str) -> Iterator[dict]:
        if self._message is None:
            return
        item, index, text = self._message, len(self._output), self._message["content"][0]["text"]
        logprobs = self._message_logprobs + self._pending_logprobs  # with tokens whose text was held back
        self._message_logprobs, self._pending_logprobs = [], []
        yield self._event("response.output_text.done", output_index=index, item_id=item["id"], content_index=0,
                          text=text, logprobs=logprobs)
        yield self._event("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                          part=text_part(text, logprobs))
        item = message_item(item["id"], text, status, logprobs)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)
        self._message = None

    def _reason(self, text: str) -> Iterator[dict]:
        if not text:
            return
        yield from self._close_message("completed")  # harmony may reason again after a message
        index = len(self._output)
        if self._reasoning is None:
            item = reasoning_item(new_item_id("rs"), None, "in_progress")
            yield self._event("response.output_item.added", output_index=index, item=item)
            yield self._event("response.content_part.added", output_index=index, item_id=item["id"],
                              content_index=0, part=reasoning_part(""))
            self._reasoning = reasoning_item(item["id"], "", "in_progress")
        self._reasoning["content"][0]["text"] += text
        yield self._event("response.reasoning_text.delta", output_index=index, item_id=self._reasoning["id"],
                          content_index=0, delta=text)

    def _close_reasoning(self, status: str) -> Iterator[dict]:
        if self._reasoning is None:
            return
        item_id, index, text = self._reasoning["id"], len(self._output), self._reasoning["content"][0]["text"]
        yield self._event("response.reasoning_text.done", output_index=index, item_id=item_id, content_index=0,
                          text=text)
        yield self._event("response.content_part.done", output_index=index, item_id=item_id, content_index=0,
                          part=reasoning_part(text))
        item = reasoning_item(item_id, text, status, self.ctx)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)
        self._reasoning = None

    def _call(self, call: ToolCall) -> Iterator[dict]:
        item_id, index = new_item_id("fc"), len(self._output)
        yield self._event("response.output_item.added", output_index=index,
                          item=call_item(item_id, call, self.ctx, ""))
        yield self._event("response.function_call_arguments.delta", output_index=index, item_id=item_id,
                          delta=call.arguments)
        yield self._event("response.function_call_arguments.done", output_index=index, item_id=item_id,
                          arguments=call.arguments)
        item = call_item(item_id, call, self.ctx)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)

    def error_event(self, error: ServingError) -> dict:
        """``response.failed``: the response so far, its status ``failed`` and the error."""
        if not isinstance(error, ServingError):
            error = EngineError(str(error))
        code = "rate_limit_exceeded" if error.status_code == 429 else "server_error"
        failed = response_object(self.ctx, "failed", self._output, error={"code": code, "message": error.message})
        return self._event("response.failed", response=failed)


def error_event(error: ServingError, after: int) -> dict:
    """OpenAI's ``error`` stream event: a replayed stream that failed outside its response's own events."""
    return {"type": "error", "sequence_number": after + 1, "code": "server_error", "message": error.message,
            "param": None}


def deleted(response_id: str) -> dict:
    """The answer to ``DELETE /v1/responses/{id}``."""
    return {"id": response_id, "object": "response.deleted", "deleted": True}
