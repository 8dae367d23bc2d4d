"""Constraint languages (issue #29) and the Responses API with the TGI client (issue #30), unchanged, against vLLM:
every server these modules start runs on ``option.rolling_batch=vllm`` (conftest). Left out: the /invocations
sniffing test, whose embeddings half needs the lean engine (vLLM embeds only with its pooling runner, a server of
its own: test_embeddings.py)."""

from tests.e2e.test_constraints import *  # noqa: F403
from tests.e2e.test_responses import (  # noqa: F401
    base,
    responses_server,
    sdk,
    test_a_function_tool_round_trip,
    test_a_responses_stream_through_sagemaker_is_json_lines_of_events,
    test_a_stream_is_typed_events_that_add_up_to_the_response,
    test_create_answers_as_chat_does,
    test_get_and_delete_and_the_404s,
    test_inference_client_streams_every_token_and_the_details,
    test_json_lines_callers_still_get_json_lines,
    test_parse_fills_a_pydantic_model_under_the_schema_grammar,
    test_previous_response_id_continues_the_conversation,
    test_the_stream_helper_gives_its_events_and_the_parsed_final_response,
    test_what_cannot_be_honoured_is_a_400_naming_the_field,
)
