"""Rerank and score on the vLLM backend: the e2e module's tests, unchanged, against servers on vLLM. The tiny random
BERT and XLM-RoBERTa cross-encoders run on vLLM's pooling runner (the classify task; BERT's second segment as vLLM's
compressed token types), their logits through our activation: the scores equal plain transformers; an embedding
model scores by cosine; the session's generating model is refused."""

from tests.e2e.test_rerank import (  # noqa: F401
    bert_url,
    expected,
    reranker,
    test_a_generating_model_is_refused,
    test_an_embedding_model_scores_by_cosine,
    test_cohere_shaped_rerank,
    test_langchain_cohere_reranker_unchanged,
    test_refusals_name_the_field,
    test_score_one_to_many_and_one_to_one,
    test_tei_rerank,
    test_tei_truncate_cuts_what_would_not_fit,
)
