"""The SageMaker LLM serving container: gunicorn + Flask on :8080, one model per worker.

The rooms, from the request down (docs/ARCHITECTURE.md draws them; tests/unit/test_architecture.py holds the
import rules): ``server`` (the app, the route table, the hooks) -> ``endpoints/`` (one module per API) ->
``protocol/`` (the wire schemas) and ``formatting/`` (events -> records) -> ``prompt/`` (chat templates, images) and
``parsing/`` (tool calls and reasoning in the output) -> ``engine/`` (the backends). Around them: ``process/``
(gunicorn's worker, SIGTERM, disconnects, start checks), ``djl/`` (a user's ``model.py``), ``service`` (settings ->
a running backend), ``config``, ``errors``, ``metrics``, ``request_log``, ``download/``, ``images/``.
"""
