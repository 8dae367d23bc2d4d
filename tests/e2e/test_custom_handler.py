"""A djl-python-style model.py in the model directory replaces the built-in handler, and can wrap it."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server

MODEL_PY = textwrap.dedent('''
    import json

    from handler.djl import Input, Output, builtin_handle

    calls = []

    def upper_lines(chunks):
        buffer = b""
        for chunk in chunks:
            buffer += chunk
            *lines, buffer = buffer.split(b"\\n")
            for line in lines:
                record = json.loads(line)
                record["token"]["text"] = record["token"]["text"].upper()
                yield json.dumps(record) + "\\n"

    def handle(inputs: Input):
        calls.append("init" if inputs.is_empty() else "request")
        if inputs.is_empty():
            assert inputs.get_properties()["model_dir"]
            return None
        body = inputs.get_as_json()
        if body.get("explode"):
            raise ValueError("asked to explode")
        if body.get("stream"):
            inner = builtin_handle(inputs)
            return Output().add_property("X-Calls", ",".join(calls)).add_stream_content(upper_lines(inner.iter_body()))
        result = builtin_handle(inputs).get_as_json()
        return (Output().add_property("X-Calls", ",".join(calls))
                .add_as_json({"generated_text": result["generated_text"].upper()}))
''')


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("custom-model")
    embedded = REPO_ROOT / "model_store" / "smollm2-135m-instruct"
    for item in embedded.iterdir():
        (model_dir / item.name).symlink_to(item)
    (model_dir / "model.py").write_text(MODEL_PY)
    server = start_server(Path(tmp_path_factory.mktemp("custom-server")), {"HF_MODEL_ID": str(model_dir)})
    yield server
    stop_server(server)


def test_user_handler_wraps_the_builtin_one(custom):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6}}
    response = requests.post(f"{custom.url}/invocations", json=body, timeout=60)
    assert response.status_code == 200
    text = response.json()["generated_text"]
    assert text == text.upper() and any(c.isalpha() for c in text)
    assert response.headers["X-Calls"].startswith("init,request")  # LMI's empty initialisation call came first


def test_user_handler_can_stream(custom):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6}, "stream": True}
    response = requests.post(f"{custom.url}/invocations", json=body, timeout=60)
    lines = [json.loads(line) for line in response.content.decode().splitlines()]
    assert len(lines) == 6 and lines[-1]["generated_text"]
    texts = [line["token"]["text"] for line in lines]
    assert all(t == t.upper() for t in texts) and any(t != t.lower() for t in texts)


def test_user_handler_failure_is_a_500_naming_the_handler_and_the_worker_keeps_serving(custom):
    response = requests.post(f"{custom.url}/invocations", json={"inputs": "x", "explode": True}, timeout=60)
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "model.py" in message and "asked to explode" in message and "Traceback" not in message
    assert requests.get(f"{custom.url}/ping", timeout=2).status_code == 200
    ok = requests.post(f"{custom.url}/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                       timeout=60)
    assert ok.status_code == 200


OWN_MODEL_PY = textwrap.dedent('''
    from handler.djl import Input, Output

    state = {}

    def handle(inputs: Input):
        if inputs.is_empty():
            state["model"] = "reverser"      # stands for a model of an architecture this server does not know
            return None
        text = inputs.get_as_json()["inputs"]
        return Output().add_as_json({"generated_text": text[::-1], "model": state["model"]})
''')


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """A handler that runs its own model: a folder with model.py and a config.json of an architecture nothing here
    implements; the built-in engine is not loaded (the handler never imports builtin_handle)."""
    model_dir = tmp_path_factory.mktemp("own-model")
    (model_dir / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    (model_dir / "model.py").write_text(OWN_MODEL_PY)
    server = start_server(Path(tmp_path_factory.mktemp("own-server")), {"HF_MODEL_ID": str(model_dir)})
    yield server
    stop_server(server)


def test_a_handler_with_its_own_model_serves_any_architecture_without_the_builtin_engine(own_model):
    assert requests.get(f"{own_model.url}/ping", timeout=5).status_code == 200
    response = requests.post(f"{own_model.url}/invocations", json={"inputs": "abc"}, timeout=30)
    assert response.status_code == 200
    assert response.json() == {"generated_text": "cba", "model": "reverser"}
    refused = requests.post(f"{own_model.url}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert refused.status_code == 404
    assert "option.builtin_engine" in refused.json()["error"]["message"]
    log = own_model.log()
    assert "the built-in engine is not loaded" in log and "loaded own-model" not in log


def test_a_handler_folder_needs_no_config_json(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.py").write_text(OWN_MODEL_PY)
    server = start_server(tmp_path, {"HF_MODEL_ID": str(tmp_path / "model")})
    try:
        response = requests.post(f"{server.url}/invocations", json={"inputs": "xy"}, timeout=30)
        assert response.json()["generated_text"] == "yx"
    finally:
        stop_server(server)


def test_a_handler_gets_the_servers_body_limits(own_model):
    """A chunked body over 6 MiB is a 413 before the handler runs (not a body silently cut at the limit)."""
    host, port = own_model.url.removeprefix("http://").split(":")
    chunk = b"x" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(8):
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server may answer and close before the whole body is sent
            pass
        received = b""
        while chunk := sock.recv(65536):  # the answer says Connection: close: read to the end
            received += chunk
        answer = received.decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert '"error"' in answer
