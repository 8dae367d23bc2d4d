"""Helpers the tests share, not tests themselves: tiny checkpoints, adapters and vision-language models built
locally (``tiny_checkpoints``, ``tiny_adapters``, ``vision_fixture``), scripted models that reason or call tools
(``thinking_model``, ``agent_model``), and loopback stand-ins for the Hugging Face Hub and S3 (``hub_stand_in``,
``s3_stand_in``). The tests, ``bench/`` and ``ci/image_test.sh`` import them as ``tests.support.<module>``."""
