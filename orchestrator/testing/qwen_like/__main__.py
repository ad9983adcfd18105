"""Regenerate the Qwen-like tokenizer files: `python -m orchestrator.testing.qwen_like [--corpus]`."""

from __future__ import annotations

import argparse

from orchestrator.testing.qwen_like import CORPUS, QWEN_LIKE_DIR, build


def main() -> None:
    """Rebuild the committed tokenizer files (with --corpus, refresh corpus.txt from the environments first)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", action="store_true", help="refresh corpus.txt from the installed environments")
    args = parser.parse_args()
    if args.corpus:
        from orchestrator.testing.qwen_like.corpus import collect_corpus

        CORPUS.write_text(collect_corpus(), encoding="utf-8")
    build(QWEN_LIKE_DIR)


if __name__ == "__main__":
    main()
