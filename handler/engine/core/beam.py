"""Beam search over one request's beams, step by step: transformers' ``generate(num_beams=...)`` rule.

Each step takes the ``[width, vocab]`` log-probabilities of the request's beams (in beam order) and keeps the
``width`` best continuations by cumulative log-probability among the top ``k = max(2, 1 + #ending ids) * width``
of all beams' candidates. A candidate that ends (an EOS or stop token, or the token limit) becomes a hypothesis
when it is among the top ``width`` of the step, scored ``sum of logprobs / generated length ** length_penalty``;
the best ``width`` hypotheses are kept. The search ends when no running beam can beat the worst kept hypothesis
(``early_stopping``: ``True`` as soon as ``width`` hypotheses exist; ``False`` judged at the current length;
``"never"`` at the longest length when ``length_penalty`` is positive), or when every candidate ends.

Beams live in slots (the request's sequences, each with its own KV cache). A step says which slot continues
which: a beam's first continuation stays in its slot, further ones move into the slots of beams that were pruned,
as copies of their parent's cache (``Step.copies``); the engine makes the copies before the next forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from handler.engine.core.request import RequestState, Sequence, Vocabulary
from handler.engine.types import BeamParams, ErrorKind, FinishReason, GenerationRequest, TokenEvent

_DROPPED = -1.0e9  # transformers' stand-in score for "not a beam" (finished candidates, empty hypothesis places)


@dataclass(slots=True)
class Beam:
    slot: int
    token_ids: list[int]
    logprobs: list[float]
    score: float                    # cumulative logprob (``_DROPPED`` for the start's duplicates)


@dataclass(frozen=True, slots=True)
class Hypothesis:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    score: float                    # length-penalised


@dataclass(frozen=True, slots=True)
class Step:
    copies: tuple[tuple[int, int], ...]     # (from slot, to slot): the cache a slot takes over before the next step
    done: bool


class BeamSearch:
    def __init__(self, params: BeamParams, max_new_tokens: int, ending_ids: frozenset[int]) -> None:
        self.params = params
        self.width = params.width
        self.max_new_tokens = max_new_tokens
        self.ending_ids = ending_ids
        self.num_candidates = max(2, 1 + len(ending_ids)) * self.width
        self.beams = [Beam(slot, [], [], 0.0 if slot == 0 else _DROPPED) for slot in range(self.width)]
        self.kept: list[Hypothesis | None] = [None] * self.width  # best first; None: an empty place
        self.improvable = True
        self.done = False
        self.length = 0             # tokens every running beam has

    def step(self, logprobs: torch.Tensor) -> Step:
        """``logprobs``: ``[width, vocab]``, row ``s`` the beam in slot ``s`` (processed: penalties, masks)."""
        vocab = logprobs.shape[1]
        by_beam = logprobs[[beam.slot for beam in self.beams]].float()
        totals = by_beam + torch.tensor([beam.score for beam in self.beams], dtype=torch.float32)[:, None]
        scores, flat = torch.topk(totals.reshape(-1), k=min(self.num_candidates, totals.numel()))
        parents, tokens = (flat // vocab).tolist(), (flat % vocab).tolist()
        at_limit = self.length + 1 >= self.max_new_tokens
        ends = torch.tensor([at_limit or token in self.ending_ids for token in tokens])
        self._keep_finished(parents, tokens, scores, ends.tolist(), by_beam)
        running = torch.topk(scores + ends.to(torch.float32) * _DROPPED, k=self.width)
        next_beams = []
        for score, k in zip(running.values.tolist(), running.indices.tolist(), strict=True):
            parent, token = self.beams[parents[k]], tokens[k]
            next_beams.append(Beam(parent.slot, parent.token_ids + [token],
                                   parent.logprobs + [by_beam[parents[k], token].item()], score))
        copies = self._assign_slots(next_beams)
        self.length += 1
        self._check_improvable()
        full = all(h is not None for h in self.kept) and self.params.early_stopping is True
        self.done = not self.improvable or full or bool(ends.all())
        return Step(tuple(copies), self.done)

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best hypotheses, best first (each kept place is filled when the search is done)."""
        return [h for h in self.kept if h is not None][:n]

    def best_so_far(self, n: int) -> list[Hypothesis]:
        """For a search cut short (the deadline): kept hypotheses and running beams, by penalised score."""
        return _best_so_far([h for h in self.kept if h is not None], self.beams, self.params.length_penalty, n)

    def tokens_of(self, slot: int) -> list[int]:
        return next(b.token_ids for b in self.beams if b.slot == slot)

    # ---- the rule's parts ---------------------------------------------------------------------------------
    def _keep_finished(self, parents: list[int], tokens: list[int], scores: torch.Tensor, ends: list[bool],
                       by_beam: torch.Tensor) -> None:
        """Candidates among the step's top ``width`` that end become hypotheses, unless the search cannot take
        more (every place is filled and ``early_stopping`` is true, or no running beam can improve)."""
        full = all(h is not None for h in self.kept) and self.params.early_stopping is True
        if full or not self.improvable:
            return
        finished = [k for k in range(min(self.width, len(tokens))) if ends[k]]
        if not finished:
            return
        penalised = (scores[finished] / ((self.length + 1) ** self.params.length_penalty)).tolist()
        new = []
        for k, score in zip(finished, penalised, strict=True):
            parent = self.beams[parents[k]]
            new.append(Hypothesis(tuple(parent.token_ids) + (tokens[k],),
                                  tuple(parent.logprobs) + (by_beam[parents[k], tokens[k]].item(),), score))
        merged = self.kept + new
        values = torch.tensor([_DROPPED if h is None else h.score for h in merged], dtype=torch.float32)
        self.kept = [merged[i] for i in torch.topk(values, k=self.width).indices.tolist()]

    def _assign_slots(self, next_beams: list[Beam]) -> list[tuple[int, int]]:
        copies = _reassign(self.beams, next_beams)
        self.beams = next_beams
        return copies

    def _check_improvable(self) -> None:
        """Can the best running beam still beat the worst kept hypothesis? Always while a place is empty."""
        if any(h is None for h in self.kept):
            return
        penalty = self.params.length_penalty
        length = self.max_new_tokens if self.params.early_stopping == "never" and penalty > 0.0 else self.length
        best_possible = self.beams[0].score / (length ** penalty)
        self.improvable = self.improvable and best_possible > min(h.score for h in self.kept)


@dataclass(slots=True)
class _Group:
    beams: list[Beam]
    kept: list[tuple[float, Hypothesis]]   # at most the group's size; (penalised score, hypothesis)
    done: bool = False

    @property
    def worst(self) -> float:
        return min(score for score, _h in self.kept) if self.kept else 1.0e9


class GroupBeamSearch:
    """Diverse beam search (arXiv 1610.02424, as transformers 4 ran it with ``num_beam_groups`` and
    ``diversity_penalty``): the beams form ``groups`` groups that search one after another within a step, and a
    group's candidates lose ``diversity_penalty`` for each time an earlier group chose the same token at this step
    (Hamming diversity). Each group keeps its own hypotheses (scored ``sum / generated length ** length_penalty``,
    the EOS not counted) and is done when they cannot improve; at the token limit every running beam is a
    hypothesis. The best ``n`` of all groups' hypotheses are returned. A done group's beams keep decoding a filler
    token (the first ending id), which later groups count as transformers' padding was counted."""

    def __init__(self, params: BeamParams, max_new_tokens: int, ending_ids: frozenset[int]) -> None:
        self.params = params
        self.width = params.width
        self.size = params.width // params.groups
        self.max_new_tokens = max_new_tokens
        self.ending_ids = ending_ids
        self.filler = min(ending_ids) if ending_ids else 0
        self.num_candidates = max(2, 1 + len(ending_ids)) * self.size
        self.groups = [_Group([Beam(g * self.size + i, [], [], 0.0 if i == 0 else _DROPPED)
                               for i in range(self.size)], []) for g in range(params.groups)]
        self.length = 0
        self.done = False

    def step(self, logprobs: torch.Tensor) -> Step:
        vocab = logprobs.shape[1]
        chosen: list[int] = []  # this step's tokens of the groups so far
        copies: list[tuple[int, int]] = []
        for group in self.groups:
            if group.done:
                for beam in group.beams:
                    beam.token_ids, beam.logprobs = beam.token_ids + [self.filler], beam.logprobs + [0.0]
                chosen += [self.filler] * len(group.beams)
                continue
            rows = logprobs[[beam.slot for beam in group.beams]].float()
            if chosen:
                rows = rows - self.params.diversity_penalty * torch.bincount(
                    torch.tensor(chosen), minlength=vocab)[:vocab].to(torch.float32)
            totals = rows + torch.tensor([beam.score for beam in group.beams], dtype=torch.float32)[:, None]
            scores, flat = torch.topk(totals.reshape(-1), k=min(self.num_candidates, totals.numel()))
            next_beams = self._process(group, (flat // vocab).tolist(), (flat % vocab).tolist(), scores.tolist(),
                                       logprobs)
            group.done = group.done or self._is_done(group, scores.max().item())
            copies += self._assign_slots(group, next_beams)
            chosen += [beam.token_ids[-1] for beam in group.beams]
        self.length += 1
        self.done = all(group.done for group in self.groups) or self.length >= self.max_new_tokens
        if self.done:
            self._finalize()
        return Step(tuple(copies), self.done)

    def _process(self, group: _Group, parents: list[int], tokens: list[int], scores: list[float],
                 logprobs: torch.Tensor) -> list[Beam]:
        """The group's next beams: candidates in order, an ending one (among the top ``size``) kept as a
        hypothesis instead of continuing."""
        next_beams: list[Beam] = []
        for rank, (parent_index, token, score) in enumerate(zip(parents, tokens, scores, strict=True)):
            parent = group.beams[parent_index]
            token_logprob = logprobs[parent.slot, token].item()
            if token in self.ending_ids:
                if rank < self.size:
                    self._add(group, score, self.length, Hypothesis(
                        tuple(parent.token_ids) + (token,), tuple(parent.logprobs) + (token_logprob,), 0.0))
            else:
                next_beams.append(Beam(parent.slot, parent.token_ids + [token], parent.logprobs + [token_logprob],
                                       score))
            if len(next_beams) == self.size:
                return next_beams
        raise RuntimeError("beam search found fewer continuations than beams")

    def _add(self, group: _Group, total: float, length: int, hypothesis: Hypothesis) -> None:
        score = total / (max(length, 1) ** self.params.length_penalty)  # an EOS first: transformers divided by 0
        if len(group.kept) < self.size or score > group.worst:
            group.kept.append((score, dataclasses.replace(hypothesis, score=score)))
            if len(group.kept) > self.size:
                group.kept.remove(min(group.kept, key=lambda item: item[0]))

    def _is_done(self, group: _Group, best_total: float) -> bool:
        if len(group.kept) < self.size:
            return False
        if self.params.early_stopping is True:
            return True
        penalty = self.params.length_penalty
        length = self.max_new_tokens if self.params.early_stopping == "never" and penalty > 0.0 else self.length
        return group.worst >= best_total / (max(length, 1) ** penalty)

    def _assign_slots(self, group: _Group, next_beams: list[Beam]) -> list[tuple[int, int]]:
        copies = _reassign(group.beams, next_beams)
        group.beams = next_beams
        return copies

    def _finalize(self) -> None:
        """At the token limit, every running beam of a group not done is a hypothesis of its group."""
        for group in self.groups:
            if not group.done:
                for beam in group.beams:
                    self._add(group, beam.score, len(beam.token_ids),
                              Hypothesis(tuple(beam.token_ids), tuple(beam.logprobs), 0.0))

    def best(self, n: int) -> list[Hypothesis]:
        ranked = sorted((item for group in self.groups for item in group.kept), key=lambda item: item[0])
        return [hypothesis for _score, hypothesis in reversed(ranked)][:n]

    def best_so_far(self, n: int) -> list[Hypothesis]:
        kept = [h for group in self.groups for _s, h in group.kept]
        running = [b for group in self.groups if not group.done for b in group.beams]
        return _best_so_far(kept, running, self.params.length_penalty, n)

    def tokens_of(self, slot: int) -> list[int]:
        return next(b.token_ids for group in self.groups for b in group.beams if b.slot == slot)


def new_search(request: GenerationRequest, eos_token_ids, max_new_tokens: int) -> BeamSearch | GroupBeamSearch:
    """The request's search: its beams end at its stop token ids and (unless ``ignore_eos``) the EOS ids."""
    stop = request.stop
    ending = set(stop.stop_token_ids) | (set() if stop.ignore_eos else set(eos_token_ids))
    kind = GroupBeamSearch if request.beam.groups > 1 else BeamSearch
    return kind(request.beam, max_new_tokens, frozenset(ending))


def send_hypotheses(state: RequestState, hypotheses: list[Hypothesis], cut: FinishReason | None, vocab: Vocabulary,
                    max_model_len: int) -> None:
    """Each hypothesis as a choice of ``state``: its tokens through a fresh ``Sequence`` (text, EOS and stop-token
    rules), the last event with its finish reason (``cut`` for a search the deadline ended); choices the search
    had no beam with tokens for (cut short) end with the timeout error. Marks the request's choices ended."""
    for index, hypothesis in enumerate(hypotheses):
        choice = Sequence.create(state, index, vocab, max_model_len)
        event, reason = None, None
        for token_id, logprob in zip(hypothesis.token_ids, hypothesis.logprobs, strict=True):
            if event is not None:
                state.events.put(event)
            accepted = choice.accept(token_id, logprob, ())
            event, reason = accepted.event, accepted.finish_reason
        if reason is None or reason is FinishReason.ERROR:
            event = dataclasses.replace(event, text=event.text + choice.detokenizer.flush())
            reason = cut or FinishReason.LENGTH
        state.events.put(dataclasses.replace(event, finish_reason=reason, num_prompt_tokens=state.num_prompt_tokens,
                                             num_generated_tokens=len(hypothesis.token_ids)))
    for index in range(len(hypotheses), state.n):  # a search cut before it had n beams with tokens
        state.events.put(TokenEvent(index=index, token_id=None, text="", finish_reason=FinishReason.ERROR,
                                    error="the request's time ran out before this beam had tokens",
                                    error_kind=ErrorKind.TIMEOUT, num_prompt_tokens=state.num_prompt_tokens))
    state.choices_ended = True


def _reassign(beams: list[Beam], next_beams: list[Beam]) -> list[tuple[int, int]]:
    """Slots for the next beams (each starts in its parent's): a parent's first continuation keeps the slot,
    further ones take the slots of ``beams`` left without one; returns the ``(from, to)`` cache copies."""
    taken: set[int] = set()
    waiting = []
    for beam in next_beams:
        if beam.slot in taken:
            waiting.append(beam)
        else:
            taken.add(beam.slot)
    free = [beam.slot for beam in beams if beam.slot not in taken]
    copies = []
    for beam, slot in zip(waiting, free, strict=True):
        copies.append((beam.slot, slot))
        beam.slot = slot
    return copies


def _best_so_far(kept: list[Hypothesis], running: list[Beam], length_penalty: float, n: int) -> list[Hypothesis]:
    """Kept hypotheses and the running beams that have tokens (as hypotheses), best penalised score first."""
    pool = kept + [Hypothesis(tuple(b.token_ids), tuple(b.logprobs), b.score / (len(b.token_ids) ** length_penalty))
                   for b in running if b.score > _DROPPED / 2 and b.token_ids]
    return sorted(pool, key=lambda h: -h.score)[:n]
