"""Everything that turns a ``GenerationRequest`` into ``TokenEvent``s. Its rooms, lowest first:

- ``types``, ``backend``: what crosses the engine's boundary (the request, the events, the backend interface).
- ``core/``: the request machinery every backend shares: request state and choices, admission, sampling,
  detokenising, grammars, prompt logprobs.
- ``model/``: our own model code (the lean decoder, its families, int8, checkpoints, vision towers).
- ``runners/``: what runs one step's forward: our model over its KV memory, or the checkpoint's transformers model.
- ``lean/``: the lean engine backend: our scheduler and step loop, around a runner.
- ``vllm/``: the vLLM backend: vLLM's engine behind the same interface.
- ``loader``: which backend serves a model folder, and building it.

Outside this package only ``types``, ``backend`` and ``loader`` are imported (tests/unit/test_architecture.py).
"""
