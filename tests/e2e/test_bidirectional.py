"""SageMaker's bidirectional stream through the real server: a WebSocket client (the ``websockets`` package) on
``/invocations-bidirectional-stream``, as SageMaker's side opens it.

Each message is a request body of any schema, answered as ``/invocations`` answers it (compared here with the same
body over HTTP, greedy), in order, many on one connection; a stream's records arrive as the fragments of one message
ended by an empty one. Fragmented and binary messages are requests too, pings are answered mid-answer, the client
leaving cancels its request (the engine's running count drops, the request is logged as aborted), the routes
SageMaker's Model-Invocation-Path can move the connection to take WebSockets, and the server's limits close the
connection with a code and a reason.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import pytest
import requests
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from devtools.local_bidi import BidirectionalCall
from tests.e2e.conftest import RunningServer, local_runtime, metric, start_server, stop_server
from tests.e2e.test_metrics import wait_until

LEGACY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8, "temperature": 0,
        "stream": True}
LONG = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}], "max_tokens": 500,
        "ignore_eos": True, "stream": True}


def ws_url(url: str, path: str = "/invocations-bidirectional-stream") -> str:
    return url.replace("http://", "ws://") + path


def answer(ws: ClientConnection) -> list[str]:
    """One answer's fragments, the empty last one that ends a stream included."""
    return list(ws.recv_streaming())


def chat_text(records: list[str]) -> str:
    chunks = [json.loads(record) for record in records if record]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks), chunks
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])


def http_chat_text(url: str, body: dict) -> str:
    with requests.post(f"{url}/invocations", json=body, stream=True, timeout=120) as response:
        assert response.status_code == 200
        return chat_text([line for line in response.iter_lines(decode_unicode=True) if line])


def test_two_requests_on_one_connection_are_answered_in_order_as_invocations_answers(url: str) -> None:
    legacy = requests.post(f"{url}/invocations", json=LEGACY, timeout=120).json()
    with connect(ws_url(url)) as ws:
        ws.send(json.dumps(LEGACY))
        ws.send(json.dumps(CHAT))  # sent before the first answer: answered after it
        first, second = answer(ws), answer(ws)
    assert [json.loads(part) for part in first] == [legacy]  # a whole answer: one frame
    assert second[-1] == "" and all(part.endswith("\n") for part in second[:-1])  # JSON lines, then the end
    assert chat_text(second) == http_chat_text(url, CHAT)


def test_a_fragmented_message_and_a_binary_one_are_requests(url: str) -> None:
    body = json.dumps(LEGACY)
    expected = requests.post(f"{url}/invocations", json=LEGACY, timeout=120).json()
    with connect(ws_url(url)) as ws:
        ws.send(iter([body[:5], body[5:20], body[20:]]))  # three frames, FIN on the last: SageMaker's PARTIAL parts
        fragmented = json.loads(ws.recv())
        ws.send(body.encode())  # a binary frame: SageMaker's DataType BINARY, its default
        binary = json.loads(ws.recv())
    assert fragmented == binary == expected


def test_pings_are_answered_while_an_answer_streams(url: str) -> None:
    with connect(ws_url(url)) as ws:
        ws.send(json.dumps({**CHAT, "max_tokens": 64, "ignore_eos": True}))
        fragments = ws.recv_streaming()
        first = next(fragments)
        pong = ws.ping(b"are you there")
        rest = list(fragments)
        assert pong.wait(30)
    assert json.loads(first)["object"] == "chat.completion.chunk" and rest[-1] == ""


def test_a_closed_socket_cancels_its_request(server: RunningServer) -> None:
    url = server.url
    tokens_before = metric(url, "llm_engine_generated_tokens_total")
    ws = connect(ws_url(url))
    ws.send(json.dumps(LONG))
    fragments = ws.recv_streaming()
    chunk = json.loads(next(fragments))
    for _ in range(3):
        next(fragments)
    wait_until(lambda: metric(url, "llm_running_requests") == 1, "the request to run")
    ws.close()  # the client goes away mid-answer
    wait_until(lambda: metric(url, "llm_running_requests") == 0, "the request's slot to free")
    assert metric(url, "llm_engine_generated_tokens_total") - tokens_before < 500  # it stopped early

    def aborted() -> bool:
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith('{"time"')]
        return any(line.get("request_id") == chunk["id"] and line["finish_reason"] == "abort"
                   and line["route"] == "/invocations-bidirectional-stream" for line in lines)

    wait_until(aborted, "the cancelled request's log line")


def test_the_query_string_carries_the_headers_a_request_reads(url: str) -> None:
    """SageMaker appends ``X-Amzn-SageMaker-Model-Query-String`` to the path: there, ``extra-parameters=ignore``
    lets a body with a field this server does not know through, as the header does on HTTP."""
    body = json.dumps({**LEGACY, "not_a_field": 1})
    with connect(ws_url(url)) as ws:
        ws.send(body)
        refused = json.loads(ws.recv())
    with connect(ws_url(url, "/invocations-bidirectional-stream?extra-parameters=ignore&other=1")) as ws:
        ws.send(body)
        answered = json.loads(ws.recv())
    assert refused["param"] == "not_a_field" and refused["code"] == 400
    assert set(answered) == {"generated_text"}


def test_the_invocation_path_moves_the_stream_to_another_route(url: str) -> None:
    with connect(ws_url(url, "/v1/chat/completions")) as ws:  # where SageMaker connects with path v1/chat/completions
        ws.send(json.dumps(CHAT))
        events = answer(ws)
    assert events[-2:] == ["data: [DONE]\n\n", ""]  # that route's own framing: server-sent events
    assert chat_text([event.removeprefix("data: ") for event in events[:-2]]) == http_chat_text(url, CHAT)
    header = {"X-Amzn-SageMaker-Model-Invocation-Path": "v1/completions"}
    with connect(ws_url(url), additional_headers=header) as ws:
        ws.send(json.dumps({"prompt": "Hello", "max_tokens": 3}))
        assert json.loads(ws.recv())["object"] == "text_completion"
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(url), additional_headers={"X-Amzn-SageMaker-Model-Invocation-Path": "v1/nothing"})
    assert refused.value.response.status_code == 404
    plain = requests.get(f"{url}/invocations-bidirectional-stream", timeout=30)
    assert plain.status_code == 400 and "WebSocket" in plain.json()["error"]
    assert requests.get(f"{url}/v1/chat/completions", timeout=30).status_code == 405  # plain HTTP as before


def test_a_message_over_the_body_limit_closes_with_1009_and_a_reason(url: str) -> None:
    with connect(ws_url(url), max_size=None) as ws:
        ws.send("x" * (6 * 1024 * 1024 + 1))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv()
    assert closed.value.rcvd.code == 1009 and "exceeds limit" in closed.value.rcvd.reason


# ---- through the local runtime, as a client of InvokeEndpointWithBidirectionalStream sees it -------------------

def test_the_local_runtime_bridges_payload_parts_and_frames(url: str) -> None:
    legacy = requests.post(f"{url}/invocations", json=LEGACY, timeout=120).json()
    for runtime_url in local_runtime(url):
        call = BidirectionalCall(runtime_url)
        call.send(json.dumps(LEGACY).encode())
        [whole] = call.answer()
        body = json.dumps(CHAT).encode()
        call.send(body[:10], "PARTIAL")  # one request in two parts: a fragmented message to the container
        call.send(body[10:])
        streamed = call.answer()
        call.end()
        assert call.answer() == []  # the client's end closes the WebSocket: no error event
        refused = BidirectionalCall(runtime_url, {"X-Amzn-SageMaker-Model-Invocation-Path": "v1/nothing"})
        refused.send(b"{}")
        assert refused.status() == 424
        error = json.loads(refused.response.read())
        assert error["OriginalStatusCode"] == 404
    assert (whole.headers["DataType"], whole.headers["CompletionState"]) == ("UTF8", "COMPLETE")
    assert json.loads(whole.payload) == legacy
    assert [m.headers["CompletionState"] for m in streamed] == ["PARTIAL"] * (len(streamed) - 1) + ["COMPLETE"]
    assert streamed[-1].payload == b""  # the empty last fragment that ends the answer
    assert chat_text([m.payload.decode() for m in streamed]) == http_chat_text(url, CHAT)


# ---- a server with a 1 s read deadline ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("bidirectional"), {"OPTION_REQUEST_READ_TIMEOUT": "1"})
    yield running
    stop_server(running)


def test_a_message_that_stops_arriving_closes_with_1008_and_stopping_with_1001(strict: RunningServer) -> None:
    resume = threading.Event()

    def half_a_message() -> Iterator[str]:
        yield '{"inputs": "Hel'
        resume.wait(60)  # the rest never comes while the server waits
        yield 'lo"}'

    ws = connect(ws_url(strict.url))
    threading.Thread(target=lambda: _send_quietly(ws, half_a_message()), daemon=True).start()
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv()
    resume.set()
    assert closed.value.rcvd.code == 1008 and "option.request_read_timeout" in closed.value.rcvd.reason
    with connect(ws_url(strict.url)) as ws:  # a stopping server closes its WebSockets: 1001, going away
        strict.process.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as stopping:
            ws.recv()
    assert stopping.value.rcvd.code == 1001 and stopping.value.rcvd.reason == "the server is stopping"


def _send_quietly(ws: ClientConnection, fragments: Iterator[str]) -> None:
    try:
        ws.send(fragments)
    except ConnectionClosed:
        pass
