"""Embeddings and a cross-encoder's scores on vLLM's pooling runner, on the backend's asyncio loop.

Every input of a job is one vLLM pooling request, all sent at once (vLLM batches them); the job answers all or none.
A cross-encoder's pair goes as its token ids with its second segment's start (vLLM's ``compressed_token_type_ids``,
which its BERT reads as the token types from there on), on the ``classify`` task without vLLM's activation: the
backend's ``ScoreJob`` applies the checkpoint's (``core.scoring``), as the lean engine does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import torch

from handler.engine.core.embedding import EmbeddingJob, ScoreJob
from handler.engine.types import TokenPair
from handler.errors import EngineError

log = logging.getLogger(__name__)


def _params(item: tuple[int, ...] | TokenPair):
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    if not isinstance(item, TokenPair):
        return TokensPrompt(prompt_token_ids=list(item)), PoolingParams(task="embed")
    extra = {"compressed_token_type_ids": item.second_start} if item.second_start < len(item.ids) else None
    return (TokensPrompt(prompt_token_ids=list(item.ids)),
            PoolingParams(task="classify", use_activation=False, extra_kwargs=extra))


async def _pool(engine, item: tuple[int, ...] | TokenPair, request_id: str) -> list[float]:
    prompt, params = _params(item)
    last = None
    async for output in engine.encode(prompt, params, request_id):
        last = output
    return last.outputs.data.reshape(-1).tolist()


async def _run(engine, job: EmbeddingJob, ids: itertools.count, what: str) -> None:
    try:
        rows = await asyncio.gather(*(_pool(engine, item, f"{job.request.request_id}-{index}-{next(ids)}")
                                      for index, item in enumerate(job.take_all())))
    except Exception as error:  # this request fails; the engine and other requests go on
        log.exception("vLLM %s %s failed", what, job.request.request_id)
        job.fail(EngineError(f"{what} failed: {type(error).__name__}: {error}"))
        return
    values = torch.tensor(rows, dtype=torch.float32)
    job.put(values[:, 0] if isinstance(job, ScoreJob) else values)  # a cross-encoder: one logit a pair


async def embed(engine, job: EmbeddingJob, ids: itertools.count) -> None:
    await _run(engine, job, ids, "embedding")


async def score(engine, job: ScoreJob, ids: itertools.count) -> None:
    await _run(engine, job, ids, "scoring")


async def warm_up(engine, scores: bool) -> None:
    """One embedding (or one pair's score) before the backend says it is ready."""
    item = TokenPair(tuple(range(1, 9)), 4) if scores else tuple(range(1, 9))
    await _pool(engine, item, "warm-up")
