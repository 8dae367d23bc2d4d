"""The e2e contract tests, unchanged, against servers on vLLM: both schemas, both framings, errors, sampling
fields, beam search, stop strings, logprobs, prompt logprobs (echo, decoder_input_details, token prompts), n /
best_of, seed, logit_bias, penalties, ignore_eos, usage, json_schema and tools (against the session's server), the
Responses API's state (logprobs, background runs, input_items, conversations, truncation, tools, sealed reasoning sent
back statelessly: servers of their own), then
cancellation on disconnect, the 429 queue bound and the deadline (a server with one batch slot, one queue place and
a 3 s deadline), a legacy batch and then clients that hang up, and SIGTERM's drain (servers of their own); vLLM's
metric names, moving under load, filled from vLLM's own scheduler figures."""

from tests.e2e.test_agent_responses import *  # noqa: F403
from tests.e2e.test_beams import *  # noqa: F403
from tests.e2e.test_chat_fields import *  # noqa: F403
from tests.e2e.test_completions import *  # noqa: F403
from tests.e2e.test_lifecycle import (  # noqa: F401
    test_a_client_that_disconnects_frees_its_slot_without_writing,
    test_sigterm_drains_in_flight_requests_and_exits_zero,
    test_streams_still_running_when_the_grace_ends_get_a_final_record_and_a_log_line,
)
from tests.e2e.test_metrics import (  # noqa: F401
    test_disconnected_stream_frees_its_slot,
    test_full_queue_is_429_and_deadlines_end_running_and_waiting_streams,
    test_non_streaming_deadline_returns_the_text_so_far_and_prompts_are_logged_when_asked,
    tight,
)
from tests.e2e.test_prompt_logprobs import *  # noqa: F403
from tests.e2e.test_responses_state import *  # noqa: F403
from tests.e2e.test_router_metrics import test_vllm_named_metrics_move_under_load  # noqa: F401
from tests.e2e.test_serving import *  # noqa: F403
from tests.e2e.test_stop_fields import *  # noqa: F403
from tests.e2e.test_tools import *  # noqa: F403


def test_embeddings_are_refused_in_one_line_naming_the_field(url: str) -> None:  # noqa: F811
    """vLLM embeds with its pooling runner, an engine of its own: this backend's engine generates."""
    import requests

    response = requests.post(f"{url}/v1/embeddings", json={"input": "Hi"}, timeout=60)
    assert response.status_code == 422 and response.json()["error"]["param"] == "input"
    assert "rolling_batch" in response.json()["error"]["message"]
