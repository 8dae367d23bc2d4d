"""How the transformers path steps a text model (``Stepping``), chosen at load by a probe against the model's own
forward over the whole sequence without a cache: the first way whose logits equal that forward's serves.

- chunked and cached (the usual): prefill chunk by chunk into the model's cache, then one token a forward from it;
- whole prompt, cached: each prompt in one forward, then decoding from the cache (a cache a later prompt chunk
  cannot resume, or resumes wrongly);
- recomputed: every step one forward over all the sequence's tokens, no cache. Exact, and slower the longer the
  sequence: for a cache this path cannot drive (minimax's own, one a forward never hands back).

A model whose forward fails without a cache too cannot serve at all: ``UnsupportedModel`` at load, in one line,
instead of a server that says it is ready and answers every request with a 500.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from handler.engine.model.support import UnsupportedModel

log = logging.getLogger(__name__)

# families whose generate computes something else than their causal forward: refused, naming why
GENERATES_OTHERWISE = {
    "xlm": "XLM generates by predicting a mask token its generate appends to the sequence each step (its "
           "prepare_inputs_for_generation), not from the causal forward this path runs",
    "xlnet": "XLNet generates by predicting a dummy token its generate appends each step, hidden from the others by "
             "a permutation mask (its prepare_inputs_for_generation), not from the causal forward this path runs",
}
PROBE_IDS = list(range(3, 14))  # a prompt of 8 tokens (chunks of 5 and 3), then 3 decoded one at a time
PROMPT_CUTS = (5, 8)


@dataclass(frozen=True, slots=True)
class Stepping:
    chunked: bool = True   # prefill chunks as the scheduler plans them (False: each prompt in one forward)
    cached: bool = True    # decode from the model's cache (False: a forward over every token, each step)
    note: str = ""         # why not the usual way (for the log and the engine path's reason)


def probe_stepping(runner) -> Stepping:
    """The first way to step ``runner``'s model (a ``TransformersRunner``) that gives its uncached logits."""
    model_type = runner.model.config.model_type
    if model_type in GENERATES_OTHERWISE:
        raise UnsupportedModel(f"{model_type}: {GENERATES_OTHERWISE[model_type]}")
    with torch.inference_mode():
        try:
            reference = runner.forward_whole(PROBE_IDS, keep=0)
        except Exception as error:  # noqa: BLE001 (any failure: this checkpoint cannot run here)
            reason = f"the checkpoint's own transformers model cannot run a forward: {type(error).__name__}: {error}"
            raise UnsupportedModel(" ".join(f"{model_type}: {reason}".split())) from None
        failed = []
        for chunked in (True, False):
            try:
                error = _difference(_stepped(runner, chunked), reference)
            except Exception as raised:  # noqa: BLE001 (any failure: try the next way)
                failed.append(f"{type(raised).__name__}: {raised}")
                continue
            if error <= _tolerance(runner.model.dtype) * max(1.0, float(reference.abs().max())):
                note = "" if chunked else "each prompt in one forward (its cache cannot resume a prompt chunk)"
                return Stepping(chunked, True, note)
            failed.append(f"{'chunked' if chunked else 'whole'} prefill from the cache is off by {error:.2g}")
    note = " ".join(f"recomputed every step without a cache (exact, slower): {failed[-1]}".split())
    log.info("transformers path: %s", note)
    return Stepping(False, False, note[:300])


def _stepped(runner, chunked: bool) -> torch.Tensor:
    """``PROBE_IDS``' logits ``[len, vocab]``: the prompt prefilled (in chunks, or whole), then decoded one by one."""
    cache, rows, start = runner._new_cache(), [], 0
    for end in PROMPT_CUTS if chunked else PROMPT_CUTS[-1:]:
        logits, cache = runner.forward_cached(cache, PROBE_IDS[start:end], start, keep=0)
        rows.append(logits)
        start = end
    for position in range(start, len(PROBE_IDS)):
        logits, cache = runner.forward_cached(cache, PROBE_IDS[position:position + 1], position)
        rows.append(logits[-1:])
    return torch.cat(rows)


def _difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    if ours.shape != reference.shape:
        return float("inf")
    return float((ours.float() - reference.float()).abs().max())


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2
