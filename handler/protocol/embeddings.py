"""The embeddings request: OpenAI's ``POST /v1/embeddings`` and the Databricks reference's body on ``/invocations``
(``input`` with none of ``messages``, ``inputs`` or ``prompt``).

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists (OpenAI's four forms);
Databricks' ``instruction`` is put before each text input, as sentence-transformers puts a prompt. ``encoding_format``
is ``float`` (lists of numbers) or ``base64`` (each vector's little-endian float32 bytes, as OpenAI sends them).
``dimensions`` is taken when it is the model's own size; this server cuts no vector shorter (a model must have been
trained for that, and nothing in a checkpoint says so). ``prepare`` tokenises each text input with the tokenizer's
own special tokens (as sentence-transformers encodes it); token-id inputs go as they are.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.types import EmbeddingRequest
from handler.errors import BadRequest
from handler.prompt.renderer import PromptRenderer
from handler.protocol.completions import check_token_ids

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
TokenId = Annotated[int, Field(strict=True, ge=0)]


class EmbeddingRequestBody(BaseModel):
    model_config = _STRICT

    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(strict=True, ge=1)] | None = None
    user: str | None = None
    instruction: str | None = None      # the Databricks reference's

    def texts(self) -> list[str] | None:
        """The text inputs (the instruction before each), or None for token-id inputs."""
        if isinstance(self.input, str):
            texts = [self.input]
        elif self.input and not all(isinstance(item, str) for item in self.input):
            return None
        else:
            texts = list(self.input)
        return [(self.instruction or "") + text for text in texts]

    def token_inputs(self) -> list[list[int]]:
        """Token-id inputs: one list of ids, or a list of them."""
        if self.input and all(isinstance(item, int) for item in self.input):
            return [list(self.input)]
        return [list(ids) for ids in self.input]

    def prepare(self, renderer: PromptRenderer, request_id: str, arrived_at: float) -> EmbeddingRequest:
        """The inputs as token ids, for the engine; ``arrived_at`` (``time.monotonic()``): when the request arrived,
        which its deadline counts from."""
        texts = self.texts()
        if self.instruction is not None and texts is None:
            raise BadRequest("instruction is put before text inputs; these are token ids", param="instruction")
        if texts is None:
            inputs = self.token_inputs()
            for index, ids in enumerate(inputs):
                check_token_ids(ids, renderer.vocab_size, "input" if len(inputs) == 1 else f"input[{index}]")
        else:
            inputs = [renderer.encode(text, add_special_tokens=True) for text in texts]
        return EmbeddingRequest(request_id, tuple(tuple(ids) for ids in inputs), arrived_at)
