"""The lean engine backend: one thread that owns a runner and runs ``schedule -> run -> postprocess`` steps over
every request in flight (``steps``), the scheduler that decides what each step runs and where its KV lives
(``scheduler``), request intake and the thread's life (``engine``), and loading a model folder into a runner
(``load``: the settings as options in ``options``, the path in ``paths``, each path's loaders in ``loaders``, int8 in
``int8``, the KV budget in ``kv_budget``).

May import: ``core``, ``runners``, ``model`` (to load them), ``types``, ``backend``. Never ``vllm``."""
