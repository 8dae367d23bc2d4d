"""LoRA adapters through the real gunicorn server (SageMaker's contract: POST/GET /adapters, DELETE
/adapters/{name}, the X-Amzn-SageMaker-Adapter-Identifier header; vLLM's ``model`` field; LMI's and TGI's legacy
parameters), over a tiny llama and tiny PEFT adapters built with peft.

The first server runs fp32 (OPTION_QUANTIZE=none) because its answers are compared token for token with PEFT's own
forward, which int8's rounded activations would not match exactly; the second runs int8 (the CPU default) and
checks that an adapter's answer is the same bits alone and beside requests under other adapters and the base.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import RunningServer, metric, start_server, stop_server
from tests.support.tiny_adapters import build_adapter, peft_greedy
from tests.support.tiny_checkpoints import build_tiny

IDENTIFIER = "X-Amzn-SageMaker-Adapter-Identifier"
NUM_TOKENS = 8
PROMPTS = {"a1": list(range(300, 340)), "a2": list(range(500, 537)), None: list(range(700, 735))}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_folders(tmp_path_factory.mktemp("adapters"))


def build_folders(root: Path, **base_overrides) -> dict[str, Path]:
    """The tiny llama (``base_overrides``: its config fields) and three adapters of it."""
    base = build_tiny(root / "base", "llama", **base_overrides)
    return {"base": base,
            "a1": build_adapter(base, root / "a1", ["q_proj", "v_proj"], rank=4, alpha=8, seed=1),
            "a2": build_adapter(base, root / "a2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"], rank=8, alpha=16, seed=2),
            "a3": build_adapter(base, root / "a3", ["o_proj", "down_proj"], rank=2, alpha=2, seed=3)}


@pytest.fixture(scope="module")
def fp32_server(tmp_path_factory, folders) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("fp32"), {
        "OPTION_MODEL_ID": str(folders["base"]), "OPTION_QUANTIZE": "none", "OPTION_ENABLE_LORA": "true",
        "OPTION_MAX_LORAS": "2", "OPTION_MAX_MODEL_LEN": "256"})
    yield running
    stop_server(running)


def register(url: str, name: str, src: Path, **options) -> requests.Response:
    return requests.post(f"{url}/adapters", json={"name": name, "src": str(src), **options}, timeout=60)


def complete(url: str, prompt: list[int], headers: dict | None = None, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 1,
            **fields}
    response = requests.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_adapters_by_header_model_and_base_in_one_batch_give_pefts_tokens(fp32_server, folders) -> None:
    url = fp32_server.url
    for name in ("a1", "a2"):
        assert register(url, name, folders[name]).status_code == 200
    reference = peft_greedy(folders["base"], {"a1": folders["a1"], "a2": folders["a2"]}, PROMPTS, NUM_TOKENS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    with ThreadPoolExecutor(3) as pool:
        by_header = pool.submit(complete, url, PROMPTS["a1"], {IDENTIFIER: "a1"})
        by_model = pool.submit(complete, url, PROMPTS["a2"], model="a2")
        base = pool.submit(complete, url, PROMPTS[None])
        answers = {"a1": by_header.result(), "a2": by_model.result(), None: base.result()}
    for adapter, answer in answers.items():
        assert answer["text"] == tokenizer.decode(reference[adapter][0], skip_special_tokens=True), adapter
    listed = requests.get(f"{url}/adapters", timeout=10).json()["adapters"]
    assert [(a["name"], a["loaded"], a["rank"]) for a in listed] == [("a1", True, 4), ("a2", True, 8)]


def test_legacy_parameters_pick_the_adapter(fp32_server, folders) -> None:
    url = fp32_server.url
    if not any(a["name"] == "a1" for a in requests.get(f"{url}/adapters", timeout=10).json()["adapters"]):
        register(url, "a1", folders["a1"])
    params = {"max_new_tokens": NUM_TOKENS, "ignore_eos": True}
    texts = {}
    for key, extra in (("lmi", {"adapters": "a1"}), ("tgi", {"adapter_id": "a1"}), ("base", {})):
        body = {"inputs": "Hello there", "parameters": {**params, **extra}}
        response = requests.post(f"{url}/invocations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        texts[key] = response.json()["generated_text"]
    header = requests.post(f"{url}/invocations", json={"inputs": "Hello there", "parameters": params},
                           headers={IDENTIFIER: "a1"}, timeout=120).json()["generated_text"]
    assert texts["lmi"] == texts["tgi"] == header != texts["base"]
    logged = [json.loads(line) for line in fp32_server.log().splitlines() if line.startswith("{") and '"route"' in line]
    assert any(line.get("adapter") == "a1" for line in logged)


def test_unknown_adapter_is_a_404_naming_it(fp32_server) -> None:
    url = fp32_server.url
    response = requests.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                             headers={IDENTIFIER: "nope"}, timeout=30)
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]
    response = requests.post(f"{url}/invocations", json={"inputs": "hi", "parameters": {"adapters": "nope"}},
                             timeout=30)
    assert response.status_code == 404 and "nope" in response.json()["error"]
    assert response.json()["param"] == "parameters.adapters"


def test_eviction_under_max_loras_and_unload(fp32_server, folders) -> None:
    url = fp32_server.url
    for name in ("a1", "a2"):
        register(url, name, folders[name])  # 409 when an earlier test registered it: fine
    complete(url, PROMPTS["a2"], {IDENTIFIER: "a2"})  # a1 is now the least recently used
    assert register(url, "a3", folders["a3"]).status_code == 200
    loaded = {a["name"]: a["loaded"] for a in requests.get(f"{url}/adapters", timeout=10).json()["adapters"]}
    assert loaded == {"a1": False, "a2": True, "a3": True}
    assert metric(url, 'llm_adapter_events_total{adapter="a1",event="evicted"}') >= 1
    complete(url, PROMPTS["a1"], {IDENTIFIER: "a1"})  # reloaded on use
    assert metric(url, 'llm_adapter_requests_total{adapter="a1"}') >= 1
    assert requests.delete(f"{url}/adapters/a3", timeout=10).status_code == 200
    assert requests.delete(f"{url}/adapters/a3", timeout=10).status_code == 404
    gone = requests.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                         headers={IDENTIFIER: "a3"}, timeout=30)
    assert gone.status_code == 404
    assert register(url, "a1", folders["a1"]).status_code == 409
    assert register(url, "bad", folders["base"]).status_code == 400  # a model folder, no adapter


def test_boto3_picks_an_adapter_by_its_inference_component(fp32_server, folders) -> None:
    """The local runtime (devtools) passes an adapter component's InferenceComponentName as the adapter header, as
    SageMaker does, so a user's boto3 code that picks adapters runs here unchanged; a base component's name is
    routing only."""
    import threading

    from devtools.local_runtime import RuntimeConfig, make_server
    from tests.e2e.conftest import runtime_client

    url = fp32_server.url
    if requests.get(f"{url}/adapters", timeout=10).json()["adapters"] == []:
        assert register(url, "a1", folders["a1"]).status_code == 200
    runtime = make_server(RuntimeConfig(container_url=url, adapter_components=frozenset({"a1", "gone"})),
                          "127.0.0.1", 0)
    threading.Thread(target=runtime.serve_forever, daemon=True).start()
    try:
        client = runtime_client(f"http://127.0.0.1:{runtime.server_address[1]}")
        body = json.dumps({"prompt": PROMPTS["a1"], "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True})

        def invoke(component: str) -> str:
            answer = client.invoke_endpoint(EndpointName="e", ContentType="application/json", Body=body,
                                            InferenceComponentName=component)
            return json.loads(answer["Body"].read())["choices"][0]["text"]

        assert invoke("a1") == complete(url, PROMPTS["a1"], {IDENTIFIER: "a1"})["text"]
        assert invoke("base-component") == complete(url, PROMPTS["a1"])["text"]
        assert invoke("a1") != invoke("base-component")
        with pytest.raises(client.exceptions.ModelError) as error:
            invoke("gone")
        assert error.value.response["OriginalStatusCode"] == 404 and "gone" in error.value.response["OriginalMessage"]
    finally:
        runtime.shutdown()
        runtime.server_close()


def test_int8_adapter_rows_do_not_depend_on_their_neighbours(tmp_path_factory, folders) -> None:
    server = start_server(tmp_path_factory.mktemp("int8"), {
        "OPTION_MODEL_ID": str(folders["base"]), "OPTION_QUANTIZE": "auto", "OPTION_ENABLE_LORA": "true",
        "OPTION_MAX_MODEL_LEN": "256"})
    try:
        url = server.url
        for name in ("a1", "a2"):
            assert register(url, name, folders[name]).status_code == 200
        alone = complete(url, PROMPTS["a1"], {IDENTIFIER: "a1"})
        with ThreadPoolExecutor(4) as pool:
            crowd = [pool.submit(complete, url, PROMPTS["a2"], {IDENTIFIER: "a2"}),
                     pool.submit(complete, url, PROMPTS[None]),
                     pool.submit(complete, url, list(range(900, 1000)), {IDENTIFIER: "a2"})]
            mixed = pool.submit(complete, url, PROMPTS["a1"], {IDENTIFIER: "a1"}).result()
            for future in crowd:
                future.result()
        assert mixed["text"] == alone["text"]
        assert mixed["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
    finally:
        stop_server(server)
