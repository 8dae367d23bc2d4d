"""NAIVE BASELINE, for the benchmark only: what a hand-rolled SageMaker handler does.

A Flask app that calls transformers' ``model.generate`` under a global lock, one request at a time (streaming
through ``TextIteratorStreamer``). It speaks just enough of the chat schema on /invocations for bench/run.py.
It is not part of the product.

    python -m bench.baseline_server MODEL_DIR PORT
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid

import torch
from flask import Flask, Response, request
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


def create_baseline_app(model_dir: str) -> Flask:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the same device and dtype as the served model's defaults: fp32 on CPU, bf16 on CUDA
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    lock = threading.Lock()
    app = Flask(__name__)

    @app.get("/ping")
    def ping() -> Response:
        return Response(status=200)

    @app.post("/invocations")
    def invocations() -> Response:
        body = request.get_json()
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"].to(device)
        options = {"max_new_tokens": body.get("max_tokens", 64), "do_sample": False,
                   "min_new_tokens": body.get("max_tokens", 64) if body.get("ignore_eos") else 0}
        if not body.get("stream"):
            with lock:
                output = model.generate(ids, **options)
            text = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)
            n = output.shape[1] - ids.shape[1]
            return Response(json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}],
                                        "usage": {"completion_tokens": n}}), mimetype="application/json")
        return Response(stream(ids, options), mimetype="application/jsonlines")

    def stream(ids, options):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with lock:
            worker = threading.Thread(target=model.generate, kwargs={"input_ids": ids, "streamer": streamer, **options})
            worker.start()
            request_id = uuid.uuid4().hex
            for piece in streamer:
                chunk = {"id": request_id, "created": int(time.time()),
                         "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                yield json.dumps(chunk) + "\n"
            worker.join()
        yield json.dumps({"id": request_id, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}) + "\n"

    return app


if __name__ == "__main__":
    model_dir, port = sys.argv[1], int(sys.argv[2])
    create_baseline_app(model_dir).run(host="127.0.0.1", port=port, threaded=True)
