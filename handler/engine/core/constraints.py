"""Constrained decoding: a grammar per request, applied as a token mask inside the batched sampler.

The library is llguidance (the guidance project's engine, in Rust). Measured on this 2-core machine with the
embedded model's 49,152-token vocabulary (``python -m bench.grammar_overhead``): a row's next-token mask plus
accepting the token take about 17 µs (p50) against about 7 µs for xgrammar 0.2.8; either is small beside the
model step (~60 ms for 16 rows) and beside applying the masks to the logits (our code, ~3 ms for 16 rows). The
choice is on the rest: xgrammar's wheel requires triton (1 GB, doubling the image) and apache-tvm-ffi; llguidance is
one 3 MB wheel with no dependencies, and its Lark grammars embed JSON schemas (``%json{...}``), which is exactly
what a forced tool call is (a marker, then arguments valid against the function's schema).

Grammars compile on the caller's thread at submit, so a bad schema is a 400 before the request is queued and the
engine thread never waits on a compile. Each choice gets its own matcher; the engine thread alone advances it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import numpy as np
import torch

from handler.engine.core.grammars import gated_grammar, to_lark
from handler.engine.core.json_rules import JSON_LAYOUT, apply_json_rules
from handler.engine.types import GrammarSpec
from handler.errors import BadRequest


class GrammarCompiler:
    """Turns a ``GrammarSpec`` into a fresh matcher. The tokenizer wrapper (~0.4 s to build) is made on first use,
    so servers that never constrain output do not pay for it at start-up."""

    def __init__(self, hf_tokenizer_factory: Callable[[], object], vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer_factory
        self.vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer(), n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
                )
            return self._tokenizer

    def compile(self, spec: GrammarSpec):
        """A new ``llguidance.LLMatcher`` for the spec; a grammar the library refuses is a 400 naming the field."""
        import llguidance

        try:
            if spec.after_reasoning is not None:
                grammar = gated_grammar(spec)
            elif spec.kind == "json_schema":
                schema = apply_json_rules(json.loads(spec.source))
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(to_lark(spec))
        except (ValueError, TypeError) as error:
            raise BadRequest(f"{spec.param} cannot be compiled: {error}", param=spec.param) from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
        if matcher.is_error():
            raise BadRequest(f"{spec.param} cannot be compiled: {matcher.get_error()}", param=spec.param)
        return matcher


def allowed_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows next: ``[len(matchers), vocab_size]`` bool.

    The packed mask is filled the way ``llguidance.torch.fill_next_token_bitmask`` does it, without importing that
    module: its import builds a ``torch.compile`` kernel (1.6 s here, on the engine thread at the first constrained
    request, and it needs a C compiler on first use)."""
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)  # [rows, words]: bit j of word i = token 32i+j
    for row, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
    # little-endian words: byte k of a row holds tokens 8k..8k+7, lowest bit first (numpy's C loop: 70 us for 16
    # rows of this vocabulary, against 1.5 ms for the same unpacking in torch ops)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")  # [rows, 32 * words] uint8
    return torch.from_numpy(bits).view(torch.bool)[:, :vocab_size]
