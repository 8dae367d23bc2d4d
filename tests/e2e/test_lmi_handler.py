"""A handler written for AWS LMI (DJL Serving) runs unchanged: ``from djl_python import Input, Output``,
``djl_python.encode_decode``, ``async def handle``, named by ``OPTION_ENTRYPOINT`` as LMI's examples spell it; and a
handler that cannot load stops the start with one line and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import REPO_ROOT, free_port, start_server, stop_server

# Written the way djl-serving's own examples are (engines/python/src/test/resources/echo/model.py and
# tests/integration/examples/custom_handlers): properties at initialisation, properties read by name, Output built
# up and returned, a stream through add_stream_content with LMI's default formatter.
MODEL_PY = textwrap.dedent('''
    import logging

    from djl_python import Input, Output

    model = None

    def load_model(properties):
        logging.info("model_dir %s", properties["model_dir"])
        return lambda text: text[::-1]

    def stream_tokens(text):
        for word in text.split():
            yield word

    def handle(inputs: Input):
        global model
        if model is None:
            model = load_model(inputs.get_properties())
        if inputs.is_empty():
            return None
        if inputs.get_property("Content-Type") != "application/json":
            return Output().error("send application/json", code=415)
        data = inputs.get_as_json()
        if data.get("stream"):
            return Output().add_stream_content(stream_tokens(data["inputs"]))
        outputs = Output()
        outputs.add_property("X-Batch-Size", str(inputs.get_batch_size()))
        outputs.add_as_json({"generated_text": model(data["inputs"])})
        return outputs
''')

# An LMI async handler decoding and encoding by content type (djl_python.encode_decode), in a file of its own that
# OPTION_ENTRYPOINT names relative to the model directory.
ASYNC_HANDLER_PY = textwrap.dedent('''
    import asyncio

    from djl_python import Input, Output
    from djl_python.encode_decode import decode, encode

    async def handle(inputs: Input):
        if inputs.is_empty():
            return None
        await asyncio.sleep(0)
        request = inputs.get_batches()[0]
        payload = decode(request, request.get_property("Content-Type"))
        texts = payload["inputs"] if isinstance(payload["inputs"], list) else [payload["inputs"]]
        prediction = [{"text": text, "length": len(text)} for text in texts]
        outputs = Output()
        encode(outputs, prediction, request.get_property("Accept") or "application/json")
        return outputs
''')


@pytest.fixture(scope="module")
def lmi(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("lmi-model")
    (model_dir / "model.py").write_text(MODEL_PY)
    server = start_server(Path(tmp_path_factory.mktemp("lmi-server")), {"HF_MODEL_ID": str(model_dir)})
    yield server
    stop_server(server)


def test_an_lmi_model_py_serves_unchanged(lmi):
    response = requests.post(f"{lmi.url}/invocations", json={"inputs": "abc"}, timeout=30)
    assert response.status_code == 200 and response.json() == {"generated_text": "cba"}
    assert response.headers["X-Batch-Size"] == "1" and response.headers["Content-Type"] == "application/json"


def test_an_lmi_stream_is_lmis_default_records(lmi):
    response = requests.post(f"{lmi.url}/invocations", json={"inputs": "one two", "stream": True}, timeout=30)
    assert response.status_code == 200
    assert [json.loads(line) for line in response.text.splitlines()] == [{"outputs": "one"}, {"outputs": "two"}]


def test_an_lmi_error_output_keeps_its_code_and_body(lmi):
    response = requests.post(f"{lmi.url}/invocations", data="abc", headers={"Content-Type": "text/plain"},
                             timeout=30)
    assert response.status_code == 415
    assert response.json() == {"code": 415, "message": "invoke handler failure", "error": "send application/json"}


@pytest.fixture(scope="module")
def lmi_async(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("lmi-async-model")
    (model_dir / "lmi_handler.py").write_text(ASYNC_HANDLER_PY)
    server = start_server(Path(tmp_path_factory.mktemp("lmi-async-server")),
                          {"HF_MODEL_ID": str(model_dir), "OPTION_ENTRYPOINT": "lmi_handler.py"})
    yield server
    stop_server(server)


@pytest.mark.parametrize(("body", "content_type", "accept", "expected"), [
    (json.dumps({"inputs": "hello"}), "application/json", None, '[{"text": "hello", "length": 5}]'),
    ("hello there", "text/plain", None, '[{"text": "hello there", "length": 11}]'),
    ("inputs\nab\nc\n", "text/csv", "text/csv", "text,length\r\nab,2\r\nc,1\r\n"),
])
def test_an_async_lmi_handler_decodes_and_encodes_by_content_type(lmi_async, body, content_type, accept, expected):
    headers = {"Content-Type": content_type, **({"Accept": accept} if accept else {})}
    response = requests.post(f"{lmi_async.url}/invocations", data=body.encode(), headers=headers, timeout=30)
    assert response.status_code == 200 and response.text == expected
    assert response.headers["Content-Type"].startswith(accept or "application/json")


def run_to_exit(tmp_path: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """The server started as SageMaker starts it, expected to stop by itself; its console, both streams."""
    environ = {**os.environ, "SAGEMAKER_BIND_TO_PORT": str(free_port()), "SERVER_HOST": "127.0.0.1",
               "SAGEMAKER_MODEL_DIR": str(tmp_path / "no-sagemaker-model"), **env}
    return subprocess.run([sys.executable, "-m", "handler", "serve"], cwd=REPO_ROOT, env=environ, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_model_py_that_cannot_import_stops_the_start_in_one_line(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.py").write_text("from djl_python import Input, Output\nimport no_such_library\n\n"
                                        "def handle(inputs: Input):\n    return Output()\n")
    result = run_to_exit(tmp_path, {"HF_MODEL_ID": str(model_dir)})
    assert result.returncode != 0
    lines = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert lines == [f"error: the custom handler {model_dir / 'model.py'} failed to load: ModuleNotFoundError: "
                     "No module named 'no_such_library'"]
    assert "Traceback" not in result.stdout
    debug = run_to_exit(tmp_path, {"HF_MODEL_ID": str(model_dir), "OPTION_LOG_LEVEL": "debug"})
    assert debug.returncode != 0 and "Traceback" in debug.stdout   # asked for: the traceback is there


def test_an_entry_point_file_that_is_not_there_stops_the_start_in_the_master(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.py").write_text("def handle(inputs):\n    return None\n")
    result = run_to_exit(tmp_path, {"HF_MODEL_ID": str(tmp_path / "model"), "OPTION_ENTRYPOINT": "missing.py"})
    assert result.returncode == 2 and "Traceback" not in result.stdout
    assert result.stdout.startswith("error: option.entryPoint='missing.py': no such file in ")
