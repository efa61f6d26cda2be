"""Write a tiny random-weight hybrid-SWA model for a real ``sglang.Engine`` on CPU.

Usage: ``python build_model.py OUT_DIR [--window 8]``. Prints a JSON summary on stdout.

Why Mellum: sglang 0.5.23 treats a model as hybrid SWA (separate FULL and SWA KV pools,
``SWATokenToKVPoolAllocator``) only for the architectures its ``is_hybrid_swa_model`` lists (GptOss,
Llama4, Gemma4, Mellum, MiMoV2, Step3p5, ...; not Gemma-2/3 or Mistral). transformers ships
``MellumConfig``; with dense MLPs it is Qwen3-style attention with a per-layer sliding window. Here:
4 layers (3 sliding-window, 1 full), hidden 64, 4 query / 2 KV heads of 16, vocabulary 512, random
weights (seed 0), float32, and a local WordLevel tokenizer (``w0`` ... ``w507`` plus 4 specials), so
nothing is fetched from a hub. Run it in its own process: the engine's processes must not load
transformers' model classes for comparison (sglang registers its own).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/engines: engine_support
from engine_support import build_model_main, save_word_level_tokenizer  # noqa: E402

VOCAB = 512


def build(out: Path, window: int) -> dict:
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    save_word_level_tokenizer(out, VOCAB)
    config = MellumConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        sliding_window=window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] * 4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32",
    )
    config.architectures = ["MellumForCausalLM"]
    torch.manual_seed(0)
    model = MellumForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    return {"path": str(out), "window": window, "parameters": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    build_model_main(__doc__, build, 8)
