"""What an image costs a vision-language model served here (issue #6): time per stage and memory under a burst.

1. Stages for one 1024x1024 JPEG (photo-like: colour gradients plus noise, quality 90) served from a loopback
   http.server: (a) fetch over http with ``handler.images`` (SSRF-checked, 127.0.0.1 allow-listed), (b) decode to
   RGB, (c) the checkpoint's processor (chat template, resize, tiling, image-token expansion), (d) the vision
   tower + connector (``VisionEncoder._image_features``, the second half of ``VisionEncoder.encode``). Median and
   p90 over ``--repeats`` runs after one warm-up, plus ``encode()`` as one call, as served, and the image-token
   count.
2. Memory: the real server (``python -m handler serve``, gunicorn + Flask) with the same model; the gunicorn
   worker's VmRSS is sampled every 20 ms. Idle RSS is taken after one warm-up image request, then 16 concurrent
   chat requests, each with a different 1024x1024 JPEG (8 by URL from the loopback server, 8 as base64 data URIs),
   max_tokens 8: peak RSS, peak minus idle, VmHWM before/after, wall time, and whether all 16 succeeded.

Both use the tiny random Idefics3 (SmolVLM architecture) of ``tests.support.vision_fixture``: its vision tower is a
toy, so (d) and the memory a tile's activations take are far below a real checkpoint's. ``--smolvlm-shape`` (minutes)
builds a random-weight model of SmolVLM-256M's exact shape and times one processor + tower pass for scale.
Nothing leaves the machine: every connection is to 127.0.0.1.

    python -m bench.vision [--repeats 10] [--smolvlm-shape]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import platform
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
import torch
from PIL import Image

from bench.run import start, stop
from handler.engine.model.vision import VisionEncoder
from handler.images import DecodeLimits, FetchPolicy, decode_image_bytes, fetch_image_bytes
from tests.support.vision_fixture import ImageServer

SIDE = 1024
BURST = 16
SAMPLE_EVERY_S = 0.02
PROMPT = "Describe this picture."
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
CPU = torch.device("cpu")


# --- images -----------------------------------------------------------------------------------------------------


def photo_jpeg(seed: int, side: int = SIDE) -> bytes:
    """A photo-like JPEG: smooth colour waves, a soft vignette and sensor-like noise, quality 90."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    waves = [np.sin(2 * np.pi * (fx * x + fy * y) + phase) for fx, fy, phase in rng.uniform(0.3, 3, (3, 3))]
    vignette = 1 - 0.6 * ((x - 0.5) ** 2 + (y - 0.5) ** 2)
    pixels = (128 + 90 * np.stack(waves, axis=-1)) * vignette[..., None] + rng.normal(0, 10, (side, side, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def data_uri(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


# --- 1. stages ----------------------------------------------------------------------------------------------------


def processor_inputs(encoder: VisionEncoder, image: Image.Image):
    """The first half of ``VisionEncoder.encode``: chat template, then the processor on text and image."""
    text = encoder.processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return encoder.processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")


def time_stages(encoder: VisionEncoder, url: str, repeats: int) -> tuple[dict[str, list[float]], object]:
    """Seconds per stage for ``repeats`` runs (one warm-up run first, not counted) and the last processor output."""
    policy, limits = FetchPolicy(allowed_hosts=("127.0.0.1",)), DecodeLimits()
    stages: dict[str, list[float]] = {}
    for run in range(repeats + 1):
        marks = [time.perf_counter()]
        data = fetch_image_bytes(url, policy, param="bench")
        marks.append(time.perf_counter())
        image = decode_image_bytes(data, limits, param="bench")
        marks.append(time.perf_counter())
        inputs = processor_inputs(encoder, image)
        marks.append(time.perf_counter())
        encoder._image_features(inputs)
        marks.append(time.perf_counter())
        encoder.encode(MESSAGES, [image])
        marks.append(time.perf_counter())
        if run == 0:
            continue
        names = ["(a) fetch, loopback http", "(b) decode to RGB", "(c) processor", "(d) vision tower + connector"]
        for name, begin, end in zip(names, marks, marks[1:], strict=False):
            stages.setdefault(name, []).append(end - begin)
        stages.setdefault("total (a)-(d)", []).append(marks[4] - marks[0])
        stages.setdefault("encode() = (c)+(d) as served", []).append(marks[5] - marks[4])
    return stages, inputs


def time_tower(encoder: VisionEncoder, inputs, repeats: int, threads: int) -> list[float]:
    """Seconds per (d) with ``threads`` torch threads (one warm-up run first); the thread count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = []
        for _ in range(repeats + 1):
            begin = time.perf_counter()
            encoder._image_features(inputs)
            seconds.append(time.perf_counter() - begin)
    finally:
        torch.set_num_threads(before)
    return seconds[1:]


def report_stages(model_dir: Path, images: ImageServer, jpeg: bytes, repeats: int) -> None:
    encoder = VisionEncoder.load(model_dir, torch.float32, CPU)
    stages, inputs = time_stages(encoder, images.url(0), repeats)
    stages["(d) again, 1 torch thread"] = time_tower(encoder, inputs, repeats, threads=1)
    print(f"\n== 1. one {SIDE}x{SIDE} JPEG ({len(jpeg) / 1024:.0f} KiB, quality 90), {repeats} runs after a warm-up ==")
    print(f"{'stage':34s} {'median ms':>10s} {'p90 ms':>10s}")
    for name, seconds in stages.items():
        print(f"{name:34s} {np.median(seconds) * 1000:10.1f} {np.percentile(seconds, 90) * 1000:10.1f}")
    tokens = int((inputs["input_ids"] == encoder.image_token_id).sum())
    tiles, side = inputs["pixel_values"].shape[1], inputs["pixel_values"].shape[-1]
    print(f"(d) ran with {torch.get_num_threads()} torch threads, as the server's one worker does here: each of the "
          "tiny tower's many small parallel regions needs both cores, so when other jobs hold them (load average "
          "above) (d) is mostly waiting and varies run to run; the 1-thread row is its compute.")
    print(f"image tokens for this image: {tokens} ({tiles} tiles of {side} px incl. the global view); "
          f"whole prompt {inputs['input_ids'].shape[1]} tokens")


# --- 2. memory under a burst ---------------------------------------------------------------------------------------


def proc_status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/{pid}/status")


def worker_pid(master: int) -> int:
    """The gunicorn worker: the master's only child (children of any of its threads)."""
    found = set()
    for children in Path(f"/proc/{master}/task").glob("*/children"):
        found.update(int(pid) for pid in children.read_text().split())
    if len(found) != 1:
        raise RuntimeError(f"expected one gunicorn worker under pid {master}, found {sorted(found)}")
    return found.pop()


class RssSampler(threading.Thread):
    """Reads a process's VmRSS (KiB) every 20 ms into ``samples`` as (monotonic time, kib)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.done = pid, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.monotonic(), proc_status_kb(self.pid, "VmRSS")))
            self.done.wait(SAMPLE_EVERY_S)

    def between(self, begin: float, end: float) -> list[int]:
        return [kib for at, kib in list(self.samples) if begin <= at <= end]


def chat(url: str, image_ref: str) -> tuple[int, float, int | None]:
    """One chat request with one image: (HTTP status, seconds, prompt tokens)."""
    content = [{"type": "image_url", "image_url": {"url": image_ref}}, {"type": "text", "text": PROMPT}]
    begin = time.monotonic()
    response = requests.post(f"{url}/v1/chat/completions", timeout=600,
                             json={"messages": [{"role": "user", "content": content}], "max_tokens": 8})
    usage = response.json().get("usage", {}) if response.ok else {}
    return response.status_code, time.monotonic() - begin, usage.get("prompt_tokens")


def burst(url: str, refs: list[str]) -> tuple[list[tuple[int, float, int | None]], float, float, float]:
    """All ``refs`` at once, one request each: the results, the burst's start and end times and its wall time."""
    with ThreadPoolExecutor(len(refs)) as pool:
        begin = time.monotonic()
        results = list(pool.map(lambda ref: chat(url, ref), refs))
        end = time.monotonic()
    return results, begin, end, end - begin


def server_env(model_dir: Path, tmp: Path) -> dict[str, str]:
    return {"OPTION_MODEL_ID": str(model_dir), "OPTION_IMAGE_FETCH_ALLOWED_HOSTS": "127.0.0.1",
            "OPTION_MAX_MODEL_LEN": "2048", "SAGEMAKER_MODEL_DIR": str(tmp / "no-sagemaker-model")}


def report_memory(model_dir: Path, images: ImageServer, jpegs: list[bytes], tmp: Path) -> None:
    log = tmp / "vision-server.log"
    process, url, ready_s = start([sys.executable, "-m", "handler", "serve"], server_env(model_dir, tmp), log)
    try:
        pid = worker_pid(process.pid)
        sampler = RssSampler(pid)
        sampler.start()
        warm = chat(url, images.url(BURST))  # the 17th JPEG, not one of the burst's
        time.sleep(1.0)
        idle = int(np.median(sampler.between(time.monotonic() - 0.5, time.monotonic())))
        hwm_before = proc_status_kb(pid, "VmHWM")
        refs = [images.url(i) for i in range(BURST // 2)] + [data_uri(jpegs[i]) for i in range(BURST // 2, BURST)]
        results, begin, end, wall = burst(url, refs)
        time.sleep(1.0)
        sampler.done.set()
        sampler.join()
        peak = max(sampler.between(begin, end + SAMPLE_EVERY_S * 2))
        after = {"rss": proc_status_kb(pid, "VmRSS"), "hwm": proc_status_kb(pid, "VmHWM")}
    finally:
        stop(process)
    print_memory(ready_s, warm, idle, peak, hwm_before, after, results, wall, process.returncode)


def print_memory(ready_s, warm, idle, peak, hwm_before, after, results, wall, exit_code) -> None:
    mib = 1 / 1024
    ok = sum(status == 200 for status, _, _ in results)
    latencies = sorted(seconds for _, seconds, _ in results)
    print(f"\n== 2. {BURST} concurrent image requests against the real server (gunicorn worker RSS every "
          f"{SAMPLE_EVERY_S * 1000:.0f} ms) ==")
    print(f"server ready in {ready_s:.1f} s; warm-up request: HTTP {warm[0]}, {warm[1]:.2f} s, {warm[2]} prompt tokens")
    print(f"idle RSS after warm-up:      {idle * mib:8.1f} MiB")
    print(f"peak RSS during the burst:   {peak * mib:8.1f} MiB")
    added = (peak - idle) * mib
    print(f"peak - idle:                 {added:8.1f} MiB  ({added / BURST:.1f} MiB a request)")
    print(f"RSS 1 s after the burst:     {after['rss'] * mib:8.1f} MiB")
    print(f"VmHWM before / after burst:  {hwm_before * mib:8.1f} / {after['hwm'] * mib:.1f} MiB "
          "(before includes the model load)")
    print(f"burst wall time: {wall:.2f} s; latency min/median/max {latencies[0]:.2f} / "
          f"{latencies[len(latencies) // 2]:.2f} / {latencies[-1]:.2f} s")
    print(f"succeeded: {ok}/{BURST} ({BURST // 2} by URL, {BURST - BURST // 2} as data URIs); prompt tokens each: "
          f"{sorted({tokens for _, _, tokens in results})}; server exit code after SIGTERM: {exit_code}")


# --- 3. SmolVLM-256M's shape -------------------------------------------------------------------------------------


def build_smolvlm_shape(path: Path) -> Path:
    """Random weights in SmolVLM-256M's exact shape: SigLIP (768 hidden, 12 layers, 512-px tiles, patch 16), pixel
    shuffle by 4 (64 tokens a tile), SmolLM2-135M's text model; processor resizing to 2048, tiles of 512."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    from tests.support.vision_fixture import IDEFICS3_TEMPLATE, IDEFICS3_TOKENS, SMOLLM2_DIR, _save, _tokenizer

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tokenizer = _tokenizer(IDEFICS3_TOKENS, eos_token="<end_of_utterance>")
    text = LlamaConfig.from_pretrained(str(SMOLLM2_DIR), vocab_size=(len(tokenizer) + 63) // 64 * 64,
                                       tie_word_embeddings=False)
    vision = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
              "image_size": 512, "patch_size": 16}
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=4,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512},
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3, do_image_splitting=True)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=64,
                                  chat_template=IDEFICS3_TEMPLATE)
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    model = Idefics3ForConditionalGeneration(config).eval()
    _save(path, model, processor, tokenizer.convert_tokens_to_ids("<end_of_utterance>"))
    return path


def report_smolvlm_shape(tmp: Path, jpeg: bytes) -> None:
    begin = time.perf_counter()
    model_dir = build_smolvlm_shape(tmp / "smolvlm-256m-shape")
    built = time.perf_counter()
    encoder = VisionEncoder.load(model_dir, torch.float32, CPU)
    loaded = time.perf_counter()
    image = decode_image_bytes(jpeg, DecodeLimits(), param="bench")
    inputs = processor_inputs(encoder, image)
    processed = time.perf_counter()
    encoder._image_features(inputs)
    encoded = time.perf_counter()
    tokens = int((inputs["input_ids"] == encoder.image_token_id).sum())
    towers = sum(p.numel() for p in encoder.model.parameters()) / 1e6
    print(f"\n== 3. SmolVLM-256M's shape (random weights, fp32, {torch.get_num_threads()} torch threads), one pass ==")
    print(f"build {built - begin:.1f} s, load vision tower + connector ({towers:.1f} M params) {loaded - built:.1f} s")
    print(f"processor: {processed - loaded:.2f} s -> {inputs['pixel_values'].shape[1]} tiles of 512 px, "
          f"{tokens} image tokens")
    print(f"vision tower + connector: {encoded - processed:.1f} s")


# --- main -------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smolvlm-shape", action="store_true", help="also time SmolVLM-256M's shape (minutes)")
    args = parser.parse_args()
    from tests.support.vision_fixture import build_tiny_vlm

    print(f"bench.vision: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), loopback only; load average "
          f"{os.getloadavg()[0]:.2f} (other jobs share these cores)")
    print("NOTE: sections 1 and 2 use tests.support.vision_fixture's tiny random Idefics3 (SmolVLM architecture): "
          "vision tower of 2 layers, hidden 32, 64-px tiles, 16 tokens a tile, images resized to 256 px longest edge. "
          "The tower and its activations are toys; see --smolvlm-shape for a real-sized tower.")
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as name:
        tmp = Path(name)
        model_dir = build_tiny_vlm(tmp / "tiny-idefics3")
        jpegs = [photo_jpeg(seed) for seed in range(BURST + 1)]
        images = ImageServer(jpegs)
        try:
            report_stages(model_dir, images, jpegs[0], args.repeats)
            report_memory(model_dir, images, jpegs, tmp)
            if args.smolvlm_shape:
                report_smolvlm_shape(tmp, jpegs[0])
        finally:
            images.close()
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
