"""Turns a ``StepPlan`` into tensors, runs the model once, and hands back the logits rows that need sampling."""

from __future__ import annotations

import hashlib
import logging
from functools import partial

import torch

from handler.engine.core import prompt_logprobs
from handler.engine.core.pooling import pool
from handler.engine.core.request import Sequence
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.layout import build_layout
from handler.engine.runners.adapters import AdapterStore
from handler.engine.runners.base import StepOutput, StepPlan, advance
from handler.engine.runners.cuda_graphs import DecodeGraphs, why_eager
from handler.engine.runners.kv_space import KVSpace
from handler.engine.runners.prefix_store import PREFIX_BLOCK, block_keys
from handler.engine.types import Pooling

log = logging.getLogger(__name__)


class ModelRunner:
    """The lean model over the engine's budgeted KV memory (``kv_space.KVSpace``): the scheduler places sequences
    in ``space``; the runner fills and reads their slots, copies cached prefixes in and offers whole prefilled
    blocks to the prefix store."""

    def __init__(self, model: DecoderModel, max_slots: int, max_len: int, budget: int,
                 prefix_caching: bool = True, adapters: AdapterStore | None = None, cuda_graphs: bool = False) -> None:
        """``cuda_graphs``: decode steps replay recorded CUDA graphs where the model allows it
        (``runners.cuda_graphs``; on a GPU, with option.enforce_eager=false)."""
        self.model = model
        self.adapters = adapters      # LoRA adapters (option.enable_lora); the model's Linears are wrapped then
        shape = model.shape
        self.space = KVSpace(shape.num_layers, shape.num_kv_heads, shape.head_dim, model.dtype, model.device,
                             budget=budget, max_len=max_len, max_slots=max_slots, prefix_caching=prefix_caching)
        self.attention_tokens = model.attention_tokens
        # prefill chunks end on whole blocks where they can (``Scheduler.chunk_align``) when attention computes a
        # partly filled block of query positions whole (the matmul path); the kernel computes only the rows it has
        self.prefill_align = model.attention.query_block
        self.groups = model.shape.num_heads // model.shape.num_kv_heads
        self.prefix_ids: tuple[int, ...] = ()
        self.prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_prefix_queries = 0   # prompt tokens admitted, and how many of them came from a cached prefix
        self.num_prefix_hits = 0
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            reason = why_eager(model)
            if reason is None:
                self.graphs = DecodeGraphs(model, self.space, max_slots)
            else:
                log.info("CUDA graphs off: %s; steps run eagerly", reason)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def set_shared_prefix(self, prefix_ids: list[int]) -> None:
        """Compute once the KV of a prefix most prompts share (the chat template's opening and default system
        prompt, often shorter than a block); prompts that start with it copy it into their slot."""
        if len(prefix_ids) < 2:
            return
        scratch = self.model.new_cache(1, len(prefix_ids))
        scratch.ensure(1, len(prefix_ids))
        layout = build_layout([], [(0, 0, len(prefix_ids))], self.groups, self.model.device)
        device = self.model.device
        self.model.forward(torch.tensor(prefix_ids, device=device), torch.arange(len(prefix_ids), device=device),
                           layout, scratch, torch.tensor([len(prefix_ids) - 1], device=device))
        self.prefix_ids = tuple(prefix_ids)
        self.prefix_kv = scratch.read(0, 0, len(prefix_ids))

    def match_prefix(self, sequence: Sequence) -> None:
        """At admission: the longest cached prefix of what the sequence will prefill (whole blocks from the prefix
        store, or the shared template prefix), always leaving one token to compute. (The scheduler does not ask
        for a prompt whose own logprobs are wanted: those need every position's logits.)"""
        target = sequence.prefill_target
        hit, source = 0, None
        store = self.space.prefixes
        if store.enabled and target > PREFIX_BLOCK:
            keys = self.block_keys(sequence, (target - 1) // PREFIX_BLOCK)
            blocks = store.match(keys)
            hit, source = len(blocks) * PREFIX_BLOCK, blocks
            session = sequence.request.request.session
            if session is not None:  # this prompt's conversation is the session's now: what it reuses stays pinned
                store.pin(session, keys[:len(blocks)], replace=True)
        shared = len(self.prefix_ids)
        # the shared prefix was computed by the base model: an adapter's prompt computes its own
        if hit < shared < target and sequence.request.adapter is None and \
                tuple(sequence.tokens(0, shared)) == self.prefix_ids:
            hit, source = shared, [self.prefix_kv]
        sequence.num_cached = sequence.num_cached_prefix = hit
        sequence.prefix_kv = source if hit else None
        self.num_prefix_queries += target
        self.num_prefix_hits += hit

    def block_keys(self, sequence: Sequence, count: int) -> list[bytes]:
        """The prefix-cache keys of the sequence's first ``count`` whole blocks (computed once, as they are
        needed); a block holding image features hashes them too."""
        keys = sequence.block_keys
        if count > len(keys):
            embeds = sequence.request.request.prompt_embeds
            extra = None if embeds is None else partial(_embeds_digest, embeds)
            # the first block's key starts from the adapter's fingerprint: KV computed under one adapter (or the
            # base model) is never shared with another
            adapter = sequence.request.adapter
            seed = b"" if adapter is None else adapter.fingerprint
            keys += block_keys(sequence.tokens(0, count * PREFIX_BLOCK), len(keys), count - len(keys),
                               keys[-1] if keys else seed, extra)
        return keys[:count]

    def embed(self, inputs: list[tuple[int, ...]], pooling: Pooling) -> torch.Tensor:
        """The inputs' pooled final-norm states, ``[len(inputs), hidden]``: one forward of their prompts as prefill
        chunks into a scratch cache that is dropped after (no KV is kept; prefixes are not reused, so an input's
        vector never depends on what was embedded before it)."""
        longest = max(len(ids) for ids in inputs)
        scratch = self.model.new_cache(len(inputs), longest)
        scratch.ensure(len(inputs), longest)
        chunks, tokens, positions, starts = [], [], [], []
        for slot, ids in enumerate(inputs):
            starts.append(len(tokens))
            chunks.append((slot, 0, len(ids)))
            tokens.extend(ids)
            positions.extend(range(len(ids)))
        device = self.model.device
        layout = build_layout([], chunks, self.groups, device)
        states = self.model.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                                    layout, scratch, torch.arange(len(tokens), device=device), hidden=True).cpu()
        padded = torch.zeros(len(inputs), longest, states.shape[-1])
        for i, (start, ids) in enumerate(zip(starts, inputs, strict=True)):
            padded[i, :len(ids)] = states[start:start + len(ids)]
        return pool(padded, [len(ids) for ids in inputs], pooling)

    def end_session(self, session_id: str) -> None:
        """A stateful session ended (closed): its blocks are no longer pinned."""
        self.space.prefixes.end_session(session_id)

    def clear_prefix_cache(self) -> None:
        self.space.prefixes.clear()
        self.num_prefix_queries = self.num_prefix_hits = 0

    def run(self, plan: StepPlan) -> StepOutput:
        tokens = [s.next_token for s in plan.decode]
        positions = [s.num_cached for s in plan.decode]
        chunks, logit_rows, sequences = [], [], []
        for row, sequence in enumerate(plan.decode):
            if not sequence.is_prefilling:
                logit_rows.append(row)
                sequences.append(sequence)
        decode_groups = self.space.decode_groups(plan.decode)
        verify_rows = self._add_verify_rows(plan, tokens, positions, decode_groups)
        num_decode_rows = len(tokens)
        row = len(tokens)
        embeds = []
        scored = []  # (sequence, start, rows) of the chunks that score their prompt
        for sequence, start, length in plan.prefill:
            if sequence.wants_prompt_logprobs:
                scored.append((sequence, start, prompt_logprobs.scored_rows(sequence, start, length, row)))
            embeds += _chunk_embeds(sequence, start, length, row)
            tokens.extend(sequence.tokens(start, start + length))
            positions.extend(range(start, start + length))
            chunks.append((sequence.kv_slot, start, length))
            row += length
            if start + length == sequence.prefill_target:
                logit_rows.append(row - 1)
                sequences.append(sequence)
            if sequence.prefix_kv is not None and start == sequence.num_cached_prefix:  # its first chunk
                self.space.load_prefix(sequence, sequence.prefix_kv)
                sequence.prefix_kv = None
        num_sampled = len(sequences)
        logit_rows += [first + i for _sequence, drafts, first in verify_rows for i in range(1 + len(drafts))]
        logit_rows += [r for _sequence, _start, rows in scored for r in rows]
        logits = self._forward(plan, tokens, positions, num_decode_rows, chunks, decode_groups, verify_rows,
                               logit_rows, embeds)
        advance(plan)
        if self.space.prefixes.enabled:
            for sequence, _start, _length in plan.prefill:
                self._store_blocks(sequence)
        logits = logits.cpu()
        verified, row = [], num_sampled
        for sequence, drafts, _first in verify_rows:
            verified.append((sequence, drafts, logits[row:row + 1 + len(drafts)]))
            row += 1 + len(drafts)
        return StepOutput(sequences, logits[:num_sampled], prompt_logprobs.split(scored, logits[row:]), verified)

    def _forward(self, plan: StepPlan, tokens: list[int], positions: list[int], num_decode_rows: int,
                 chunks: list, decode_groups: list, verify_rows: list, logit_rows: list[int],
                 embeds: list) -> torch.Tensor:
        """The model's logits for the step's ``logit_rows``: a recorded CUDA graph's replay where the step is one
        (``cuda_graphs``: decode rows only, each sampled, all in one run of one slab's slots), else the forward."""
        if (self.graphs is not None and not plan.prefill and not plan.verify and len(decode_groups) == 1
                and len(logit_rows) == len(plan.decode) <= self.graphs.max_rows
                and isinstance(decode_groups[0][0], tuple)):
            return self.graphs.run(decode_groups[0][0], tokens, positions)
        device = self.model.device
        # attention reads whole key blocks: a row's result then does not depend on how long its neighbours are,
        # and shapes repeat (on CUDA each new key length cost ~80 ms the first time)
        layout = build_layout(positions[:num_decode_rows], chunks, self.groups, device, decode_groups)
        self._group_adapters(plan, verify_rows)
        try:
            return self.model.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                                      layout, self.space, torch.tensor(logit_rows, dtype=torch.long, device=device),
                                      _join_embeds(embeds, device))
        finally:
            self._group_adapters(None, [])

    def _group_adapters(self, plan: StepPlan | None, verify_rows: list[tuple[Sequence, tuple[int, ...], int]]) -> None:
        """Tell the model's adapter layers which rows of this step run under which adapter, in the row order
        ``run`` builds: decode rows, verify rows, then prefill chunks (no plan: none, after the step)."""
        batch = self.model.adapter_batch
        if batch is None or plan is None:
            if batch is not None:
                batch.set_groups([])
            return
        owners = list(plan.decode) + [s for s, drafts, _first in verify_rows for _ in range(1 + len(drafts))]
        owners += [s for s, _start, length in plan.prefill for _ in range(length)]
        rows: dict[int, tuple[object, list[int]]] = {}
        for row, sequence in enumerate(owners):
            adapter = sequence.request.adapter
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].append(row)
        batch.set_groups(list(rows.values()), self.model.device)

    def _add_verify_rows(self, plan: StepPlan, tokens: list[int], positions: list[int],
                         decode_groups: list) -> list[tuple[Sequence, tuple[int, ...], int]]:
        """A speculating sequence's next token and drafts as decode rows of its slot at consecutive positions
        (appended to ``tokens``, ``positions`` and the decode groups); returns ``(sequence, drafts, first row)``."""
        verify_rows = []
        for sequence, drafts in plan.verify.items():
            verify_rows.append((sequence, drafts, len(tokens)))
            tokens += [sequence.next_token, *drafts]
            positions += range(sequence.num_cached, sequence.num_cached + 1 + len(drafts))
            decode_groups.append((self.space.repeat_group(sequence, 1 + len(drafts)), 1 + len(drafts)))
        return verify_rows

    def _store_blocks(self, sequence: Sequence) -> None:
        """Offer the prefix store the whole blocks this sequence's prefill has computed so far (never decoded
        ones: a cached block is then exactly what a prefill of the same tokens computes)."""
        count = min(sequence.num_cached, sequence.prefill_target) // PREFIX_BLOCK
        if count > sequence.num_stored_blocks:
            keys = self.block_keys(sequence, count)[sequence.num_stored_blocks:]
            self.space.store_blocks(sequence, keys, sequence.num_stored_blocks, sequence.request.request.session)
            sequence.num_stored_blocks = count


def _chunk_embeds(sequence: Sequence, start: int, length: int, first_row: int) -> list[tuple[list[int], torch.Tensor]]:
    """The flat-batch rows and values of a prompt's input embeddings that fall in this prefill chunk."""
    embeds = sequence.request.request.prompt_embeds
    if embeds is None:
        return []
    offsets, values = embeds.in_chunk(start, length)
    return [([first_row + offset for offset in offsets], values)] if offsets else []


def _join_embeds(embeds: list[tuple[list[int], torch.Tensor]], device: torch.device) -> tuple | None:
    if not embeds:
        return None
    rows = [r for chunk_rows, _values in embeds for r in chunk_rows]
    values = torch.cat([values for _rows, values in embeds]).to(device)
    return torch.tensor(rows, dtype=torch.long, device=device), values


def _embeds_digest(embeds, block: int) -> bytes:
    """A digest of the image features inside prompt block ``block`` (b"" when it has none)."""
    offsets, values = embeds.in_chunk(block * PREFIX_BLOCK, PREFIX_BLOCK)
    if not offsets:
        return b""
    digest = hashlib.blake2b(bytes(str(offsets), "ascii"), digest_size=16)
    digest.update(values.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.digest()
