"""The lean engine's intake of work that runs one forward and keeps no KV: texts to embed, and a cross-encoder's
pairs to score. Each is checked here (400 naming the input), queued as a job on the engine thread's inbox, and
batched by the step loop between generation steps (``steps.StepLoop._embed``).
"""

from __future__ import annotations

from collections.abc import Callable

from handler.engine.backend import EngineLimits
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.embedding import EmbeddingJob, ScoreJob, check_inputs
from handler.engine.types import EmbeddingRequest, ScoreRequest
from handler.errors import BadRequest


class PoolingIntake:
    """The engine's embeddings and scores: checked on the caller's thread against the loaded model, then queued on
    the engine thread's inbox (``Engine`` owns one and hands it what it reads)."""

    def __init__(self, loaded: Callable[[], object | None], check_ready: Callable[[], None],
                 put: Callable[[EmbeddingJob], None], admission: AdmissionControl, is_alive: Callable[[], bool],
                 limits: EngineLimits) -> None:
        self._model, self._check_ready, self._put = loaded, check_ready, put
        self._admission, self._is_alive, self.limits = admission, is_alive, limits

    @property
    def _loaded(self):  # engine.LoadedModel, once loaded (None before)
        return self._model()

    @property
    def embeds_only(self) -> bool:
        """An encoder checkpoint: embeddings only (a cross-encoder: scores only, ``score_type``)."""
        return self._loaded is not None and self._loaded.path == "encoder"

    @property
    def score_type(self) -> str | None:
        """How this model scores pairs: ``cross-encoder`` (its classifier head), ``bi-encoder`` (the cosine of its
        embeddings: an encoder, or a decoder whose folder says how it embeds), or None (a generating model)."""
        if self._loaded is None:
            return None
        if self._loaded.scoring is not None:
            return "cross-encoder"
        embedding = self._loaded.embedding
        if self._loaded.path == "encoder" or getattr(embedding, "source", None) == "sentence-transformers":
            return "bi-encoder"
        return None

    def score(self, request: ScoreRequest) -> ScoreJob:
        """Queue pairs for the cross-encoder to score; raises ``ServingError`` when this model cannot."""
        self._check_ready()
        if self._loaded.scoring is None:
            raise BadRequest("this model is not a cross-encoder: it scores no pairs with a classifier head",
                             param=request.param)
        check_inputs(request, self.limits.max_model_len, self._loaded.vocab_size)
        job = ScoreJob(request, self._admission.deadline(request.arrived_at), self._is_alive,
                       self._admission.timeout_error, activation=self._loaded.scoring.name)
        self._put(job)
        return job

    def embed(self, request: EmbeddingRequest) -> EmbeddingJob:
        """Queue inputs to embed; raises ``ServingError`` when this model cannot embed them."""
        self._check_ready()
        if isinstance(self._loaded.embedding, str):
            raise BadRequest(f"this model cannot embed: {self._loaded.embedding}", param=request.param)
        check_inputs(request, self.limits.max_model_len, self._loaded.vocab_size)
        job = EmbeddingJob(request, self._admission.deadline(request.arrived_at), self._is_alive,
                           self._admission.timeout_error)
        self._put(job)
        return job
