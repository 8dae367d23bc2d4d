"""A stateful session keeps its conversation warm: later-turn time to first token with and without the session,
while other traffic would otherwise evict the conversation's prefix.

Serves the embedded model (int8 on CPU, the shipped default) with stateful sessions on and a KV budget small
enough that the competing traffic's prompts fill the prefix cache several times over (``--kv-cache-memory``,
``--max-model-len``). Two 10-turn chats (greedy, 32 tokens a turn, each turn's answer kept in the history) under
system prompts of their own (~``--system-tokens`` tokens): one in a session (``X-Amzn-SageMaker-Session-Id``), one
without. Before each turn of either, ``--competitors`` requests with distinct ~``--competitor-tokens``-token prompts
run one after another. Each turn streams (JSON lines on ``/invocations``); its time to first token and the
prefix-cache hits it got (``llm_prefix_cache_hits_tokens_total``) are recorded.

Prints one JSON object: each chat's per-turn TTFT and hits, and the medians of turns 2-10. Loopback only; nothing
else should run meanwhile (2 cores).

    python -m bench.sessions [--turns 10] [--kv-cache-memory 256MiB] [--max-model-len 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import requests

from bench.kv_memory import serve, text_of
from tests.e2e.conftest import RunningServer, stop_server

REPO = Path(__file__).resolve().parent.parent
SESSION = "X-Amzn-SageMaker-Session-Id"
QUESTIONS = ["What is the river called?", "Who owns the mill?", "How old is the dog?", "Why does the fox jump?",
             "What colour is the fox?", "Where does the river go?", "Is the mill still working?",
             "What does the dog eat?", "When does the fox sleep?", "Who else lives by the river?"]


def counter(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def settled_hits(url: str, queries_before: float, hits_before: float) -> int:
    """The prefix hits one request got: the counters are reported after the engine's step, so wait until its
    queries are in."""
    deadline = time.monotonic() + 10
    while counter(url, "llm_prefix_cache_queries_tokens_total") <= queries_before and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(counter(url, "llm_prefix_cache_hits_tokens_total") - hits_before)


def turn(url: str, messages: list[dict], session_id: str | None) -> dict:
    """One streamed chat turn: its TTFT, its answer's text, and the prefix hits it got."""
    queries, hits = (counter(url, f"llm_prefix_cache_{k}_tokens_total") for k in ("queries", "hits"))
    headers = {SESSION: session_id} if session_id else {}
    start, first, text = time.perf_counter(), None, []
    with requests.post(f"{url}/invocations", json={"messages": messages, "max_tokens": 32, "temperature": 0,
                                                   "stream": True}, headers=headers, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            record = json.loads(line)
            delta = record["choices"][0]["delta"].get("content") if record.get("choices") else None
            if delta and first is None:
                first = time.perf_counter() - start
            text.append(delta or "")
    return {"ttft_s": round(first, 3), "text": "".join(text), "hits": settled_hits(url, queries, hits)}


def compete(url: str, count: int, tokens: int, round_: int) -> None:
    """``count`` requests with prompts no conversation shares, one after another."""
    for index in range(count):
        prompt = f"Competitor {round_}-{index}. " + text_of(tokens)
        requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
                      timeout=300).raise_for_status()


def run(server: RunningServer, args: argparse.Namespace) -> dict:
    url = server.url
    opened = requests.post(f"{url}/invocations", json={"requestType": "NEW_SESSION"}, timeout=30)
    session_id = opened.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
    chats = {"session": {"id": session_id, "messages": []}, "no_session": {"id": None, "messages": []}}
    for name, chat in chats.items():
        chat["messages"].append({"role": "system", "content": f"Notes for the {name} reader. "
                                                             + text_of(args.system_tokens)})
        chat["turns"] = []
    for number in range(args.turns):
        for chat in chats.values():
            compete(url, args.competitors, args.competitor_tokens, number)
            chat["messages"].append({"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]})
            result = turn(url, chat["messages"], chat["id"])
            chat["messages"].append({"role": "assistant", "content": result.pop("text")})
            chat["turns"].append(result)
    requests.post(f"{url}/invocations", json={"requestType": "CLOSE"}, headers={SESSION: session_id}, timeout=30)
    out = {}
    for name, chat in chats.items():
        later = chat["turns"][1:]
        out[name] = {"ttft_s": [t["ttft_s"] for t in chat["turns"]], "hits": [t["hits"] for t in chat["turns"]],
                     "later_ttft_median_s": round(statistics.median(t["ttft_s"] for t in later), 3)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=800)
    parser.add_argument("--competitors", type=int, default=3)
    parser.add_argument("--competitor-tokens", type=int, default=1200)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--max-model-len", default="2048")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = serve(REPO, Path(tmp), {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true",
                                         "OPTION_KV_CACHE_MEMORY": args.kv_cache_memory,
                                         "OPTION_MAX_MODEL_LEN": args.max_model_len})
        try:
            result = run(server, args)
        finally:
            stop_server(server)
    print(json.dumps({"settings": vars(args), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
