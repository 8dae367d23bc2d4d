"""What runs one step's forward: the interface the step loop drives (``base``: a ``StepPlan`` in, a ``StepOutput``
out), our model over its budgeted KV memory (``model_runner``, ``kv_cache``), and the checkpoint's own transformers
model (``hf_runner``).

May import: ``core`` (sequences, prompt logprobs), ``model``, ``types``. Never a backend (``lean``, ``vllm``)."""
