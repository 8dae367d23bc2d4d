"""The front door: one module per API, each an ``Endpoint`` that owns its route functions, its parse -> prepare ->
submit -> format path, and the shape of its errors.

``chat``, ``completions``, ``legacy`` (LMI and TGI), ``responses`` (with its store), ``embeddings``, ``rerank`` (and
score), ``tokenizer``, ``adapters``, ``models``, ``health`` (``/ping``, ``/metrics``) and ``invocations``
(SageMaker's route: the body says which API answers). ``base`` holds what every route does (``Call``,
``FrontDoor``, ``Endpoint``, ``answers``) and ``body`` reads a request's body. ``server``'s route table says which
route goes to which endpoint.

A new API is one module here, with one ``Endpoint`` subclass, and its lines in ``server.route_table``.

May import: ``base`` and ``body`` (never another endpoint: what two share belongs in ``base``), and the layers
below: the wire schemas (``protocol``), the formatters (``formatting``), the prompt layer, ``service``,
``request_log``, ``adapter_registry``, ``metrics``, the engine's interface, ``handler.errors``
(``tests/unit/test_architecture.py`` holds these rules).
"""
