"""The clients SageMaker users already have, with their own documented calls, against the real server through
the local SageMaker runtime (loopback, dummy credentials): litellm's ``sagemaker/`` and ``sagemaker_chat/``
providers (plain and streaming) and langchain-aws' ``SagemakerEndpoint`` with the content handler from its
docstring.

litellm copies its ``sagemaker_base_url`` routing setting into the request body, which the default unknown-field
rule refuses; InvokeEndpoint forwards only a few caller headers, so the opt-out travels as
``X-Amzn-SageMaker-Custom-Attributes: extra-parameters=ignore`` (litellm's ``sagemaker_chat/`` sends a caller's
``extra_headers``; its ``sagemaker/`` provider drops them) or is the deployment's ``option.extra_parameters``.
Credentials come from the environment, as litellm's docs set them (passed as arguments, litellm copies them into
the body too).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import RunningServer, local_runtime, runtime_client, start_server, stop_server

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list at import

IGNORE = {"X-Amzn-SageMaker-Custom-Attributes": "trace-id=abc; extra-parameters=ignore"}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION_NAME": "us-east-1"}
# sagemaker_chat/ sends the messages (the chat template applies); sagemaker/ sends their text as a raw prompt
QUESTION = {"sagemaker_chat": [{"role": "user", "content": "What is the capital of France?"}],
            "sagemaker": [{"role": "user", "content": "The capital of France is"}]}


@pytest.fixture(scope="module")
def runtime_url(url: str) -> Iterator[str]:
    """The local runtime in front of the session's server (default settings)."""
    yield from local_runtime(url)


@pytest.fixture(scope="module")
def tgi_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A deployment that ignores unknown fields and answers the legacy schema in TGI's list shape."""
    running = start_server(tmp_path_factory.mktemp("tgi"), {"OPTION_EXTRA_PARAMETERS": "ignore",
                                                             "OPTION_LEGACY_RESPONSE": "tgi"})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def tgi_runtime_url(tgi_server: RunningServer) -> Iterator[str]:
    yield from local_runtime(tgi_server.url)


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


def litellm_call(model: str, base: str, stream: bool, **fields):
    import litellm

    path = "invocations-response-stream" if stream else "invocations"
    messages = QUESTION[model.split("/")[0]]
    return litellm.completion(model=model, messages=messages, max_tokens=12, temperature=0.0, stream=stream,
                              sagemaker_base_url=f"{base}/endpoints/local/{path}", **fields)


def streamed_text(response) -> str:
    return "".join(chunk.choices[0].delta.content or "" for chunk in response)


def test_litellm_chat_with_the_opt_out_in_custom_attributes(runtime_url: str) -> None:
    answer = litellm_call("sagemaker_chat/local", runtime_url, False, extra_headers=IGNORE)
    assert "Paris" in answer.choices[0].message.content
    assert "Paris" in streamed_text(litellm_call("sagemaker_chat/local", runtime_url, True, extra_headers=IGNORE))


@pytest.mark.parametrize("model", ["sagemaker/local", "sagemaker_chat/local"])
def test_litellm_with_the_opt_out_as_the_deployment_setting(tgi_runtime_url: str, model: str) -> None:
    assert "Paris" in litellm_call(model, tgi_runtime_url, False).choices[0].message.content
    assert "Paris" in streamed_text(litellm_call(model, tgi_runtime_url, True))


def test_without_an_opt_out_the_unknown_field_is_named(runtime_url: str) -> None:
    import litellm

    with pytest.raises(litellm.exceptions.BadRequestError) as caught:
        litellm_call("sagemaker_chat/local", runtime_url, False)
    assert "sagemaker_base_url" in str(caught.value)


def test_langchain_aws_sagemaker_endpoint_with_its_docstring_handler(tgi_runtime_url: str) -> None:
    from langchain_aws.llms import SagemakerEndpoint
    from langchain_aws.llms.sagemaker_endpoint import LLMContentHandler

    class ContentHandler(LLMContentHandler):  # as langchain-aws' SagemakerEndpoint docstring writes it
        content_type = "application/json"
        accepts = "application/json"

        def transform_input(self, prompt: str, model_kwargs: dict) -> bytes:
            return json.dumps({"inputs": prompt, "parameters": model_kwargs}).encode("utf-8")

        def transform_output(self, output) -> str:
            return json.loads(output.read().decode("utf-8"))[0]["generated_text"]

    llm = SagemakerEndpoint(endpoint_name="local", client=runtime_client(tgi_runtime_url),
                            content_handler=ContentHandler(), model_kwargs={"max_new_tokens": 8})
    assert "Paris" in llm.invoke("The capital of France is")
