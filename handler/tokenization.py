"""Prompt rendering: the model's own tokenizer and chat template, with template failures reported as 400s."""

from __future__ import annotations

from handler.errors import BadRequest, Unprocessable


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


class PromptRenderer:
    """Wraps a transformers tokenizer for the protocol layer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """A single token's own text, as TGI reports it in ``details.tokens``."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

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

    def render_chat(self, messages: list[dict]) -> list[int]:
        """The conversation rendered by the model's chat template, ending with the assistant's turn."""
        if not self.has_chat_template:
            raise Unprocessable("this model has no chat template; send the legacy {\"inputs\": ...} schema instead",
                                param="messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # jinja's raise_exception (e.g. "roles must alternate") and type errors
            raise BadRequest(f"the model's chat template rejected the messages: {error}", param="messages") from None
        return self.encode(text)
