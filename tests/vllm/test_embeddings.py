"""Embeddings on the vLLM backend (issue #27): the e2e encoder test, unchanged, against a server on vLLM. The tiny
random BERT sentence-transformers folder runs on vLLM's pooling runner, pooled as the folder says (our pooling,
given to vLLM as its pooler config): the vectors equal plain transformers + torch, and generation is refused."""

from tests.e2e.test_embeddings import (  # noqa: F401
    bert_url,
    test_an_encoder_serves_embeddings_and_refuses_generation,
)
