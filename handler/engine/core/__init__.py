"""The request machinery every backend shares: a request's state and its choices (``request``),
the wait queue and deadline (``admission``), sampling, incremental detokenising with stop strings, grammars
(``constraints``, ``json_rules``), prompt logprobs, and the model folder's tokenizer facts.

May import: ``handler.engine.types`` and ``backend``, ``handler.errors``, ``handler.config``. Never a backend
(``lean``, ``vllm``), a runner or the model code."""
