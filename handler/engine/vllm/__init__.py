"""The vLLM backend: vLLM's engine behind the same interface as the lean engine. ``backend``: the asyncio loop
thread and the backend's life; ``requests``: one choice as a vLLM request and its outputs as our events;
``beams``: beam search (``core.beam``'s rule) over vLLM's next-token logprobs;
``args``: settings and requests as vLLM's arguments, as plain data (tested without vLLM); ``prepare``: what the
backend needs before vLLM starts.

May import: ``core``, ``types``, ``backend``, ``model.vision`` (the checkpoint's processor), ``handler.config``.
Never ``lean`` or ``runners``. vLLM itself is imported only inside functions: this package loads only where vLLM
serves."""
