"""Prompt rendering: the model's own tokenizer and chat template, with template failures reported as 400s."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from handler.engine.types import ReasoningGate
from handler.errors import BadRequest, Unprocessable
from handler.parsing import dialects, reasoning
from handler.prompt.pairs import PairTokenizer
from handler.prompt.tools import render_calls, template_renders_tools, tools_system_prompt


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A chat prompt as the engine takes it: token ids, and for vision models the image embeddings (the lean
    engine) or the images themselves (a backend with its own vision tower)."""

    prompt_ids: tuple[int, ...]
    embeds: object | None = None    # handler.engine.types.PromptEmbeds
    images: object | None = None    # handler.engine.types.PromptImages


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted (byte-level BPE vocabularies are written in it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image in a chat request: its URL, data URI or base64 text, and the field it came from."""

    ref: str
    param: str                  # e.g. messages[0].content[1]
    detail: str = "auto"        # OpenAI's image detail: auto, low, high


class PromptRenderer:
    """Wraps a transformers tokenizer for the protocol layer: chat templates, tools, tokens' text.

    ``tool_format`` is how this model writes tool calls (``handler.parsing.dialects.FORMATS``): the setting
    when given, else detected from the chat template."""

    def __init__(self, tokenizer, tool_format: str = "auto", reasoning_parser: str = "auto") -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.has_chat_template = bool(template)
        self.tool_format = dialects.detect_format(template, None if tool_format == "auto" else tool_format)
        self._template_renders_tools = template_renders_tools(template)
        # OpenAI's developer role is the system role for models that have no developer role of their own (gpt-oss's
        # harmony has one): a template that never names it would render it as an unknown role, or drop it (Qwen3's)
        self._knows_developer = "developer" in str(template or "")
        # gpt-oss's template writes each tool as "// " + description, and fails on a tool without one
        self._template_needs_descriptions = reasoning.detect_parser(
            template if isinstance(template, str) else None, "auto") == "gpt_oss"
        self.tool_marker_id = self._special_token_id(dialects.FORMATS[self.tool_format].opener)
        self.reasoning_parser = reasoning.detect_parser(template if isinstance(template, str) else None,
                                                        reasoning_parser)
        # the reasoning markers that are special tokens: kept in the output text, or the split could not see them
        found = (self._special_token_id(text) for text in reasoning.marker_texts(self.reasoning_parser))
        self.reasoning_keep_ids = tuple(token_id for token_id in found if token_id is not None)

    def opens_reasoning(self, prompt_ids: tuple[int, ...]) -> bool:
        """Whether the model answering this prompt starts inside its reasoning (the prompt's tail opened it)."""
        if self.reasoning_parser is None:
            return False
        tail = self.tokenizer.decode(list(prompt_ids[-8:]))
        return reasoning.prompt_opens_reasoning(self.reasoning_parser, tail)

    def reasoning_gate(self, prompt_ids: tuple[int, ...]) -> ReasoningGate | None:
        """Where a constrained answer starts for this prompt: after ``</think>``, or for gpt-oss as the harmony
        ``final`` channel's message (None: no reasoning; or a harmony model whose tokenizer lacks harmony's special
        tokens, which the gate names: there the grammar applies from the first token)."""
        if self.reasoning_parser is None:
            return None
        if self.reasoning_parser == "gpt_oss":
            return ReasoningGate("", "", True, style="harmony") if self.speaks_harmony else None
        return ReasoningGate(reasoning.THINK_START, reasoning.THINK_END, self.opens_reasoning(prompt_ids))

    @property
    def speaks_harmony(self) -> bool:
        """Whether the model writes gpt-oss's harmony with all its markers as special tokens, which the grammars
        for harmony output (the reasoning gate, forced calls) name."""
        return self.reasoning_parser == "gpt_oss" and len(self.reasoning_keep_ids) == len(reasoning.HARMONY_TOKENS)

    def _special_token_id(self, text: str) -> int | None:
        """The id of ``text`` when the tokenizer has it as one special token (Mistral's ``[TOOL_CALLS]``, Llama's
        ``<|python_tag|>``): the model writes it as that token, which detokenising would otherwise drop."""
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        if token_id is None or self.tokenizer.convert_ids_to_tokens(token_id) != text:  # unknown: the unk id
            return None
        return token_id if token_id in set(self.tokenizer.all_special_ids) else None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @functools.cached_property
    def pairs(self) -> PairTokenizer:
        """The tokenizer for rerank and score: pairs of texts (a cross-encoder's) and texts alone, cut as asked."""
        return PairTokenizer(self.tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids' text, special tokens included (what echo shows of a token prompt, as vLLM decodes it)."""
        return self.tokenizer.decode(token_ids)

    @property
    def vocab_size(self) -> int:
        """How many token ids the tokenizer knows, added tokens included."""
        return len(self.tokenizer)

    def token_text(self, token_id: int) -> str:
        """A single token's own text, as TGI reports it in ``details.tokens``."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's own strings for ids (byte-level pieces such as "Ġworld" as they are), as vLLM's
        ``/tokenize`` reports them."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        """A single token's exact bytes (a byte-level token may be half of a UTF-8 character)."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if all(ch in _BYTE_DECODER for ch in piece) and self._is_byte_level:
            return bytes(_BYTE_DECODER[ch] for ch in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")

    @property
    def _is_byte_level(self) -> bool:
        decoder = getattr(self.tokenizer, "backend_tokenizer", None)
        return decoder is not None and "ByteLevel" in type(decoder.decoder).__name__

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """The conversation rendered by the model's chat template, ending with the assistant's turn."""
        return self.encode(self.chat_text(messages, tools, template_kwargs=template_kwargs))

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                      images: list[ImageRef] | None = None, arrived_at: float | None = None,
                      template_kwargs: dict | None = None) -> RenderedPrompt:
        """``render_chat`` for messages that may hold images (``{"type": "image"}`` parts, refs in order);
        ``arrived_at`` (``time.monotonic()``) is when the request arrived, which image budgets count from."""
        if images:
            raise BadRequest("this model is not a vision model: it cannot take image content", param=images[0].param)
        return RenderedPrompt(tuple(self.render_chat(messages, tools, template_kwargs)))

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None, *,
                  add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        """The chat template's text. A template that renders tools gets them (``tools=``) and the earlier calls
        and tool results as they are, in its own format (gpt-oss's harmony, Qwen3's ``<tool_call>``), with each
        call's arguments as an object; otherwise tools are described in the system prompt, and earlier calls are
        written into the assistant messages, in the format the output is parsed in."""
        if not self.has_chat_template:
            raise Unprocessable("this model has no chat template; send the legacy {\"inputs\": ...} schema instead",
                                param="messages")
        extra = dict(template_kwargs or {})  # chat_template_kwargs (enable_thinking, ...), reasoning_effort
        if not self._knows_developer:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        if self._template_renders_tools:
            messages = [_with_call_arguments(message) for message in messages]
            if tools:
                extra["tools"] = [_with_description(t) for t in tools] if self._template_needs_descriptions else tools
        else:
            messages = self.with_tools(messages, tools or [])
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **extra)
        except Exception as error:  # jinja's raise_exception (e.g. "roles must alternate") and type errors
            raise BadRequest(f"the model's chat template rejected the messages: {error}", param="messages") from None

    def with_tools(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """The messages with tools described in the system prompt and earlier calls written into the text."""
        if tools or any(m.get("tool_calls") for m in messages):
            return self._with_tools_in_text(messages, tools)
        return messages

    def _with_tools_in_text(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        rendered = []
        for message in messages:
            if message.get("tool_calls"):
                calls = render_calls(message["tool_calls"], self.tool_format)
                text = message.get("content") or ""
                message = {**message, "content": f"{text}\n{calls}" if text else calls}
                del message["tool_calls"]
            rendered.append(message)
        if not tools:
            return rendered
        description = tools_system_prompt(tools, self.tool_format)
        if rendered and rendered[0]["role"] == "system" and isinstance(rendered[0].get("content"), str):
            return [{**rendered[0], "content": f"{rendered[0]['content']}\n\n{description}"}, *rendered[1:]]
        return [{"role": "system", "content": description}, *rendered]


def _with_description(tool: dict) -> dict:
    """A tool whose function has a ``description``: an empty one where the request left it out (OpenAI makes it
    optional). Harmony's own renderer writes a description's lines as ``// `` comments, so an empty one adds no
    text; gpt-oss's template writes the comment marker regardless, which is the closest it can render."""
    function = tool.get("function") or {}
    if function.get("description") is not None:
        return tool
    return {**tool, "function": {**function, "description": ""}}


def _with_call_arguments(message: dict) -> dict:
    """An assistant message whose calls' ``arguments`` (OpenAI's JSON text) are objects, as chat templates take them
    (transformers' tool-use docs; vLLM does the same): gpt-oss's template writes ``arguments|tojson``, which would
    quote the text a second time. Arguments that are not JSON stay as they were sent."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function = {**function, "arguments": json.loads(arguments)}
            except ValueError:
                pass
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}
