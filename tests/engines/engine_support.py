"""What the engine suites' model builders and server drivers share: the local word-level tokenizer
the tiny test models are served with (nothing fetched from a hub), and a server's process tree.

Imported by scripts that run in the engines' own environments (``sglang_engine/build_model.py``,
``vllm_engine/build_model.py`` put this folder on ``sys.path``) and by the server drivers."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Callable

#: The tokenizer's special tokens, ids 0 .. 3.
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def save_word_level_tokenizer(out: Path, vocab_size: int) -> None:
    """Write a WordLevel tokenizer of ``vocab_size`` ids (the specials, then ``w0``, ``w1``...) split on
    white space into ``out`` (``PreTrainedTokenizerFast.save_pretrained``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(vocab_size - len(SPECIALS))})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(out)


def process_tree(pid: int) -> list:
    """The process ``pid`` and all its descendants (``psutil.Process``), or ``[]`` once it is gone."""
    import psutil

    try:
        main = psutil.Process(pid)
        return [main] + main.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_for_tree(proc: subprocess.Popen, tree: list, start: float, timeout_s: float) -> "tuple[float, list]":
    """After a stop was sent at ``start`` (``time.monotonic()``): wait up to ``timeout_s`` for
    ``proc`` and every process of its ``tree`` to end; kill what is left. Returns the seconds until
    the tree had ended and the pids still alive then."""
    from opentelemetry.instrumentation.swa_sglang.stop_paths import alive

    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    while alive(tree) and time.monotonic() - start < timeout_s:
        time.sleep(0.05)
    seconds, leftover = time.monotonic() - start, alive(tree)
    for process in leftover:
        try:
            process.kill()
        except Exception:  # gone in the meantime
            pass
    return seconds, [p.pid for p in leftover]


def build_model_main(doc: str, build: "Callable[[Path, int], dict]", window: int) -> None:
    """A model builder's command line: ``OUT_DIR [--window N]`` (default ``window``); prints the
    builder's summary as one JSON line."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--window", type=int, default=window)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(build(args.out, args.window)))
