"""Write a tiny random-weight hybrid Gemma-3 text model for a real ``vllm.LLM`` on CPU.

Usage: ``python build_model.py OUT_DIR [--window 32]``. Prints a JSON summary on stdout.

transformers' ``Gemma3TextConfig`` / ``Gemma3ForCausalLM`` (vLLM's ``Gemma3ForCausalLM`` serves it):
4 layers alternating ``sliding_attention`` and ``full_attention``, so vLLM's hybrid KV cache manager
makes two KV cache groups (one sliding-window, one full) sharing one tensor per layer pair; hidden
128, 4 query / 2 KV heads of 32 (vLLM's CPU_ATTN backend takes head sizes 32, 64, 80, ...),
vocabulary 512, random weights (seed 0), float32, and a local WordLevel tokenizer (``w0`` ... ``w507``
plus 4 specials), so nothing is fetched from a hub. Run it in its own process: the engine's process
must not import transformers' model classes for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/engines: engine_support
from engine_support import build_model_main, save_word_level_tokenizer  # noqa: E402

VOCAB = 512
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def build(out: Path, window: int) -> dict:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    save_word_level_tokenizer(out, VOCAB)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        sliding_window=window, layer_types=list(LAYER_TYPES),
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    return {"path": str(out), "window": window, "layer_types": LAYER_TYPES,
            "parameters": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    build_model_main(__doc__, build, 32)
