"""Embeddings as OpenAI's ``list`` object (also the Databricks reference's shape): one ``embedding`` entry an
input, in order, with ``usage``."""

from __future__ import annotations

import base64
import struct

from handler.engine.types import Embeddings


def embedding_list(result: Embeddings, model: str, encoding_format: str) -> dict:
    data = [{"object": "embedding", "index": index, "embedding": _encode(vector, encoding_format)}
            for index, vector in enumerate(result.vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}}


def _encode(vector: tuple[float, ...], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's SDK decodes it (numpy.frombuffer float32)
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)
