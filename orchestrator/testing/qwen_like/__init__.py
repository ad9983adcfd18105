"""An offline Qwen3-like tokenizer for the policy double: a small byte-level BPE and a Qwen3-like chat template.

Real chat templates break the prefix property a trainer relies on: Qwen3's drops `<think>` from assistant turns
before the last user query, re-serializes tool calls from the parsed JSON, and a decoded completion re-encodes to
other ids than were sampled. The toy tokenizer never shows that; this one does, with the real libraries
(`tokenizers`, transformers' `apply_chat_template`), without a model hub.

The committed files (tokenizer.json, tokenizer_config.json, special_tokens_map.json) are test data: `build`
regenerates them deterministically from `corpus.txt` (the environments' own text, refreshed by `collect_corpus`)
and `qwen3_template.jinja`. Rebuild with `python -m orchestrator.testing.qwen_like`.

Importing this module is cheap; `tokenizers` is imported by `build` only (the `tito` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN_LIKE_DIR: Path = Path(__file__).resolve().parent
CORPUS = QWEN_LIKE_DIR / "corpus.txt"
TEMPLATE = QWEN_LIKE_DIR / "qwen3_template.jinja"
VOCAB_SIZE = 3072

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# As in Qwen3: the chat markers are special (a server drops them from decoded text), the think and tool markers are
# not, so they survive `skip_special_tokens` and a tool parser sees them.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2/3's pre-tokenizer split: words with their leading space or punctuation, single digits, punctuation runs.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What the policy double thinks aloud in its <think> block (in the corpus too, so it tokenizes in words).
REASONING = (
    "Let me think about this step by step.",
    "I should use the python tool to compute the answer, then call submit with the exact result.",
    "The tool returned the result. Now I can submit the answer.",
    "I will read the repository, run the tests and fix the failing code.",
)


def build(out_dir: Path, corpus: str | None = None) -> None:
    """Train the byte-level BPE on `corpus` (default: corpus.txt) and write the tokenizer files into out_dir."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    text = CORPUS.read_text(encoding="utf-8") if corpus is None else corpus
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_chunks(text), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *MARKER_TOKENS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 32768,
        "chat_template": TEMPLATE.read_text(encoding="utf-8"),
    }
    special_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "additional_special_tokens": list(MARKER_TOKENS)}
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out_dir / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _chunks(text: str) -> list[str]:
    # One training example per paragraph, in file order, so the pair counts (and the merges) are the same each run.
    return [p for p in text.split("\n\n") if p.strip()]


def thinking_in_prompt(out_dir: Path) -> Path:
    """A copy of the tokenizer in out_dir/"qwen-thinking" whose template ends the generation prompt with `<think>\\n`,
    as DeepSeek-R1's and Qwen3-Thinking-2507's do (the turn starts inside its thinking); its path."""
    gen = "{{- '<|im_start|>assistant\\n' }}"
    config = json.loads((QWEN_LIKE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config["chat_template"]
    if template.count(gen) != 1:
        raise ValueError("the template's generation prompt is not where thinking_in_prompt expects it")
    config["chat_template"] = template.replace(gen, gen + "{{- '<think>\\n' }}")
    out = out_dir / "qwen-thinking"
    out.mkdir(parents=True)
    for name in FILES:
        data = json.dumps(config, indent=2) if name == "tokenizer_config.json" else (QWEN_LIKE_DIR / name).read_text()
        (out / name).write_text(data, encoding="utf-8")
    return out
