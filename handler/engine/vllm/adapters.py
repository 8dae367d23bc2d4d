"""LoRA adapters on vLLM (option.enable_lora): our registry of names and folders over vLLM's own adapter cache.

It uses vLLM's adapter API (``AsyncEngineArgs``' ``enable_lora``, ``max_loras``, ``max_lora_rank``,
``max_cpu_loras``; ``vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)``; ``AsyncLLM.add_lora`` /
``remove_lora`` / ``pin_lora``; ``generate(..., lora_request=...)``), and ``make test-vllm`` runs the adapter e2e
tests against it (``tests/vllm/test_adapters.py``: PEFT's own greedy tokens). vLLM loads, caches and evicts adapters
itself (least recently used, ``max_loras`` on the device per batch, ``max_cpu_loras`` in host memory), so no load or
evict events are reported from here; a request names a registered adapter and carries its ``LoRARequest``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from handler.engine.types import AdapterInfo
from handler.errors import BadRequest, Conflict, NotFound

_WAIT_S = 60.0
BASE_NAME = "base-model-no-adapter"  # the weightless adapter base requests carry (``VllmAdapters``)


@dataclass(slots=True)
class _Entry:
    name: str
    src: str
    pinned: bool
    request: object          # vllm.lora.request.LoRARequest
    rank: int


class VllmAdapters:
    """``backend.AdapterManager`` over vLLM's engine; ``engine`` and ``loop`` are the backend's once started.

    Requests without an adapter run under an adapter of no weights (``base_request``), pinned in one of vLLM's slots
    (``args`` gives vLLM one slot more than option.max_loras for it). Why: vLLM 0.32's CPU LoRA kernels
    (``lora/ops/torch_ops``) pick each row's slot as ``weights[index]``, and a row without an adapter has index -1,
    which Python reads as the last slot: a base request decoded beside (or after) adapter requests got the last
    slot's adapter applied (measured: the base answer alone was PEFT's, beside two adapters it was another text).
    vLLM refuses an adapter of no modules, so it is one rank-1 LoRA of zeros on the first attention projection (every
    other module of its slot is zeros too), and the base rows add exact zeros."""

    def __init__(self, engine: Callable[[], object], loop: Callable[[], asyncio.AbstractEventLoop],
                 max_rank: int, model_dir: Path) -> None:
        self._engine, self._loop, self.max_rank, self.model_dir = engine, loop, max_rank, model_dir
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)   # vLLM's lora_int_id must be > 0 and unique per adapter
        self._lock = threading.Lock()
        self._base: object | None = None  # the LoRARequest of no weights the base model's requests carry
        self._base_folder: tempfile.TemporaryDirectory | None = None

    def base_request(self) -> object:
        """The ``LoRARequest`` requests without an adapter carry (created, loaded and pinned on first use)."""
        with self._lock:
            if self._base is None:
                from vllm.lora.request import LoRARequest

                self._base_folder = tempfile.TemporaryDirectory(prefix="base-adapter-")
                folder = Path(self._base_folder.name)
                _write_zero_adapter(self.model_dir, folder)
                request = LoRARequest(BASE_NAME, next(self._ids), str(folder))
                self._call("add_lora", request)
                self._call("pin_lora", request.lora_int_id)
                self._base = request
            return self._base

    def register(self, name: str, src: str, *, preload: bool = True, pin: bool = False,
                 folder: Path | None = None) -> AdapterInfo:
        """``folder``: where ``src``'s files are (the server downloads an ``s3://`` src first); unset: ``src`` is
        a local folder."""
        from vllm.lora.request import LoRARequest

        if folder is None and src.startswith("s3://"):
            raise BadRequest(f"src {src}: an s3:// src is downloaded by the server (POST /adapters), not here",
                             param="src")
        folder = folder or Path(src.removeprefix("file://"))
        rank = _checked_rank(folder, self.max_rank)
        with self._lock:
            if name in self._entries:
                raise Conflict(f"the adapter {name} already exists; DELETE /adapters/{name} before registering it "
                               "again", param="name")
            entry = _Entry(name, src, pin, LoRARequest(name, next(self._ids), str(folder)), rank)
            if preload or pin:
                self._call("add_lora", entry.request)
            if pin:
                self._call("pin_lora", entry.request.lora_int_id)
            self._entries[name] = entry
        return AdapterInfo(name, src, pin, preload or pin, rank)

    def unregister(self, name: str) -> None:
        with self._lock:
            entry = self._entries.pop(name, None)
        if entry is None:
            raise NotFound(f"The adapter {name} was not found", param="name", code="adapter_not_found")
        self._call("remove_lora", entry.request.lora_int_id)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [AdapterInfo(e.name, e.src, e.pinned, True, e.rank) for e in self._entries.values()]

    def resolve(self, name: str, param: str = "adapter") -> object:
        """The ``LoRARequest`` a request names; 404 naming it when unknown."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"The adapter {name} was not found (GET /adapters lists them)", param=param,
                           code="adapter_not_found")
        return entry.request

    def drain_events(self) -> list[tuple[str, str]]:
        return []

    def _call(self, method: str, *args) -> object:
        """Run one of AsyncLLM's adapter coroutines on the backend's loop and wait for it."""
        future = asyncio.run_coroutine_threadsafe(getattr(self._engine(), method)(*args), self._loop())
        return future.result(_WAIT_S)


def _checked_rank(folder: Path, max_rank: int) -> int:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise BadRequest(f"{folder}: not a PEFT adapter folder (no adapter_config.json)", param="src")
    rank = json.loads(path.read_text()).get("r")
    if not isinstance(rank, int) or rank < 1 or rank > max_rank:
        raise BadRequest(f"{path}: rank {rank} is greater than max_lora_rank ({max_rank}, option.max_lora_rank) or "
                         "not a positive integer", param="src")
    return rank


# the projections a zero adapter may sit on, in order of preference (llama-style, fused, GPT-2, NeoX)
_ZERO_TARGETS = ("q_proj", "qkv_proj", "c_attn", "query_key_value", "o_proj", "down_proj")


def _write_zero_adapter(model_dir: Path, folder: Path) -> None:
    """A PEFT folder of one rank-1 LoRA of zeros on the first layer's attention projection of ``model_dir``'s
    checkpoint (shapes read from its safetensors headers)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            shapes.update({name: handle.get_slice(name).get_shape() for name in handle.keys()})
    for target in _ZERO_TARGETS:
        names = sorted(n for n, shape in shapes.items() if n.endswith(f".{target}.weight") and len(shape) == 2)
        if names:
            module = names[0].removesuffix(".weight")
            out_features, in_features = shapes[names[0]]
            break
    else:
        raise BadRequest(f"{model_dir}: no attention projection ({', '.join(_ZERO_TARGETS)}) to hold the base "
                         "model's zero adapter", param="adapter")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": [target], "bias": "none"}))
    save_file({f"base_model.model.{module}.lora_A.weight": torch.zeros(1, in_features),
               f"base_model.model.{module}.lora_B.weight": torch.zeros(out_features, 1)},
              str(folder / "adapter_model.safetensors"))
