"""Speculative decoding on the vLLM backend: option.speculative_draft_model=ngram becomes vLLM's
``speculative_config`` (prompt lookup), and a summary of the prompt, which copies it, is the same greedy text as the
session's server without drafts. A request's own drafting (``num_assistant_tokens``) is the lean engine's: 422."""

from __future__ import annotations

import requests

from tests.e2e.conftest import start_server, stop_server

SOURCE = ("The container serves a language model on SageMaker. It speaks the OpenAI chat-completions schema and the "
          "classic inputs and parameters schema. It starts in seconds and answers both schemas from one engine.")
BODY = {"messages": [{"role": "user", "content": f"Repeat this text word for word:\n\n{SOURCE}"}], "max_tokens": 48,
        "temperature": 0}


def test_prompt_lookup_gives_the_answer_without_drafts(url: str, tmp_path) -> None:
    plain = requests.post(f"{url}/v1/chat/completions", json=BODY, timeout=120).json()["choices"][0]
    server = start_server(tmp_path, {"OPTION_SPECULATIVE_DRAFT_MODEL": "ngram", "OPTION_SPECULATIVE_LENGTH": "4"})
    try:
        assert "speculative_config" in server.log()
        drafted = requests.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=120).json()["choices"][0]
        refused = requests.post(f"{server.url}/v1/chat/completions", json={**BODY, "num_assistant_tokens": 2},
                                timeout=60)
    finally:
        stop_server(server)
    assert drafted["message"]["content"] == plain["message"]["content"]
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "num_assistant_tokens"
