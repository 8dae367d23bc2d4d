"""Constrained decoding: a grammar per request, applied as a token mask inside the batched sampler.

The library is llguidance (Microsoft's guidance engine in Rust). Measured on this 2-core machine with the embedded
model's 49,152-token vocabulary (``python -m bench.grammar_overhead``): about 20 µs per token to compute a row's
next-token mask, against about 170 µs for xgrammar 0.2.8, whose wheel also pulls in triton (1 GB). JSON schemas
and Lark grammars (with JSON schemas embedded as ``%json{...}``, which tool calls use) compile in milliseconds.

Grammars compile on the caller's thread at submit, so a bad schema is a 400 before the request is queued and the
engine thread never waits on a compile. Each choice gets its own matcher; the engine thread alone advances it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import torch

from handler.engine.types import GrammarSpec
from handler.errors import BadRequest

_BITS = torch.arange(32, dtype=torch.int32)
# One line with json.dumps' separators: a small model given free whitespace can fill max_tokens with newlines and
# indentation (seen with forced tool calls), and this is the spacing models see most.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


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
            if spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec.source), defaults=JSON_LAYOUT)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.source)
        except (ValueError, TypeError) as error:
            raise BadRequest(f"{spec.param} cannot be compiled: {error}", param=spec.param) from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
        if matcher.is_error():
            raise BadRequest(f"{spec.param} cannot be compiled: {matcher.get_error()}", param=spec.param)
        return matcher


def allowed_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows next: ``[len(matchers), vocab_size]`` bool."""
    import llguidance.torch

    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)  # [rows, ceil(vocab / 32)] int32
    for row, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
    # bit j of word i allows token 32 * i + j (llguidance.torch's own apply step is a torch.compile kernel,
    # which needs a C compiler and took 12 s on first use here; this is three tensor ops)
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [rows, words, 32]
    return bits.reshape(len(matchers), -1)[:, :vocab_size].bool()
