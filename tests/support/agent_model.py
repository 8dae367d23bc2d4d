"""A tiny llama built to act as a coding agent for one turn: greedy decoding reasons, calls a tool, then, shown the
tool's output, answers. Tiny random checkpoints cannot do that, so this one is scripted as
``tests/support/thinking_model.py`` scripts its transcript (a token-only chain model: each token's successor is
fixed), with two chains:

- from the last token of the generation prompt (``\\n`` of ``<|im_start|>assistant\\n``):
  ``<think>Run the command</think><tool_call>{"name":"exec_command","arguments":{"cmd":"echo hi"}}</tool_call>``, a call
  in Qwen3's (hermes) format to Codex CLI's shell tool;
- from the last token of the generation prompt after a tool's output, which this model's template closes the
  reasoning in (``<think>\\n\\n</think>\\n\\n``, what Qwen3's template writes for ``enable_thinking=false``): ``Done.``

The chat template is Qwen3's real one with that one change (its generation prompt after a ``tool`` message), so the
turn after a tool result starts from another token than the first turn does; everything else (how it renders tools,
calls, tool results and earlier reasoning) is Qwen3's. The tokenizer is the embedded one with Qwen3's ``<think>``,
``</think>``, ``<tool_call>`` and ``</tool_call>`` added (Qwen3's tokenizer has each as one token), and two pieces of
JSON, ``":{"`` and ``"}}``: a chain must not repeat a token, and without them the call's ten quotes cannot be cut into
vocabulary tokens that are all different (``distinct_tokens`` finds the cut).

``max_position_embeddings`` is long by default (32768): Codex CLI's first request is about 40 KB (~11k tokens).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.thinking_model import TEMPLATE, write_chains

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
JSON_PIECES = ('":{"', '"}}')
REASONING = "Run the command"
COMMAND = "echo hi"
CALL = '{"name":"exec_command","arguments":{"cmd":"echo hi"}}'
TRANSCRIPT = f"<think>{REASONING}</think><tool_call>{CALL}</tool_call>"
ANSWER = "Done."
QWEN3_GENERATION_PROMPT = "{%- if enable_thinking is defined and enable_thinking is false %}"
MAX_TRIES = 100_000
AGENT_GENERATION_PROMPT = ("{%- if (enable_thinking is defined and enable_thinking is false) or "
                           "messages[-1].role == 'tool' %}")


def agent_template() -> str:
    template = TEMPLATE.read_text()
    assert template.count(QWEN3_GENERATION_PROMPT) == 1
    return template.replace(QWEN3_GENERATION_PROMPT, AGENT_GENERATION_PROMPT)


def distinct_tokens(tokenizer, text: str, taken: set[int]) -> list[int]:
    """Token ids whose texts join into ``text``, none repeated and none in ``taken`` (longest tokens tried first; the
    markers are their added tokens; the search gives up after ``MAX_TRIES`` steps)."""
    pieces: dict[str, list[int]] = {}
    specials = set(tokenizer.all_special_ids)
    for token, token_id in tokenizer.get_vocab().items():
        if token_id not in specials:
            pieces.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(token_id)
    longest = max(len(piece) for piece in pieces)

    tries = 0

    def search(start: int, used: set[int]) -> list[int] | None:
        nonlocal tries
        tries += 1
        if tries > MAX_TRIES:
            return None
        if start == len(text):
            return []
        for end in range(min(len(text), start + longest), start, -1):
            for token_id in pieces.get(text[start:end], ()):
                if token_id in used:
                    continue
                rest = search(end, used | {token_id})
                if rest is not None:
                    return [token_id, *rest]
        return None

    found = search(0, set(taken))
    assert found is not None, f"no cut of {text!r} into distinct tokens"
    return found


def build_agent_llama(path: Path, **overrides) -> Path:
    """The agent model in ``path``; ``overrides`` are config fields over ``build_tiny``'s tiny defaults."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tests.support.tiny_checkpoints import SMOLLM2_DIR, build_tiny

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS + JSON_PIECES])
    build_tiny(path, "llama", vocab_size=len(tokenizer), **{"max_position_embeddings": 32768, **overrides})
    template = agent_template()
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(template)

    first_start, second_start = tokenizer.convert_tokens_to_ids("Ċ"), tokenizer.convert_tokens_to_ids("ĊĊ")
    taken = {first_start, second_start, tokenizer.eos_token_id}
    call = distinct_tokens(tokenizer, TRANSCRIPT, taken)
    answer = distinct_tokens(tokenizer, ANSWER, taken | set(call))
    for ids, text in ((call, TRANSCRIPT), (answer, ANSWER)):
        assert tokenizer.decode(ids) == text
    eos = tokenizer.eos_token_id
    return write_chains(path, [[first_start, *call, eos], [second_start, *answer, eos]])
