"""boto3's sagemaker-runtime client, unmodified, against the real server through the local SageMaker runtime."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import local_runtime, runtime_client


@pytest.fixture(scope="module")
def runtime(url):
    for runtime_url in local_runtime(url):
        yield runtime_client(runtime_url)


def test_invoke_endpoint_legacy(runtime):
    response = runtime.invoke_endpoint(EndpointName="local", ContentType="application/json",
                                       Body=json.dumps({"inputs": "The capital of France is",
                                                        "parameters": {"max_new_tokens": 8}}))
    assert "Paris" in json.loads(response["Body"].read())["generated_text"]


def test_invoke_endpoint_chat(runtime):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24}
    response = runtime.invoke_endpoint(EndpointName="local", ContentType="application/json", Body=json.dumps(body))
    assert "Paris" in json.loads(response["Body"].read())["choices"][0]["message"]["content"]


def test_response_stream_reassembled_across_payload_parts(runtime):
    body = {"inputs": "Translate 'good morning' to Chinese:", "parameters": {"max_new_tokens": 16}, "stream": True}
    response = runtime.invoke_endpoint_with_response_stream(EndpointName="local", ContentType="application/json",
                                                            Body=json.dumps(body))
    buffer, lines, parts = b"", [], 0
    for event in response["Body"]:
        buffer += event["PayloadPart"]["Bytes"]
        parts += 1
        *complete, buffer = buffer.split(b"\n")
        lines += [json.loads(line) for line in complete]
    assert buffer == b"" and parts > len(lines)  # 16-byte parts cut lines; every record still ends with \n
    assert lines[-1]["generated_text"] == "".join(line["token"]["text"] for line in lines)


def test_bad_request_surfaces_as_model_error(runtime):
    with pytest.raises(runtime.exceptions.ModelError) as caught:
        runtime.invoke_endpoint(EndpointName="local", ContentType="application/json",
                                Body=json.dumps({"inputs": "x", "parameters": {"temperature": -1}}))
    error = caught.value.response
    assert error["OriginalStatusCode"] == 400
    assert "temperature" in error["OriginalMessage"]
