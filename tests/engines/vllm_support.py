"""vLLM 0.33's real classes for the ``vllm`` tests, and what the tests build around them.

Nothing here stands in for vLLM: the KV cache manager, the scheduler, the requests and the configs
are vLLM's own (installed by ``.ci/vllm-tests.sh``: ``vllm==0.33.0 --no-deps`` and the import
requirements in ``.ci/vllm-requirements.txt``; ``vllm._C`` and the GPU are never needed for them).
What the tests need beside them:

* :func:`load_vllm` (behind the ``vllm_classes`` fixture): vLLM's classes, or a skip when vLLM
  does not import, turned into a failure when ``OTEL_SWA_REQUIRE_VLLM=1`` (the CI script sets it);
* :func:`vllm_source_dir`: the installed source, found without importing vLLM;
* :func:`write_tiny_llama`: a two-layer Llama ``config.json`` in a directory of the test's own
  (``ModelConfig`` reads a local folder; ``HF_HUB_OFFLINE=1`` keeps it off the network; no weights
  are read: nothing here runs a model);
* :func:`hybrid_kv_cache_config`: one ``FullAttentionSpec`` group and one ``SlidingWindowSpec``
  group sharing one block pool, as vLLM builds for a hybrid model;
* :func:`recount`: a batch's counts by plain loops over the real block tables.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from otel_swa import environment_variables as ev

#: Set to 1 (as ``.ci/vllm-tests.sh`` does) to make a failed vLLM import fail the ``vllm`` tests
#: instead of skipping them.
REQUIRE_VLLM = ev.OTEL_SWA_REQUIRE_VLLM

#: The attention layers of :func:`write_tiny_llama`'s model, one per KV cache group.
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def unavailable(reason: str) -> None:
    """Skip the test, or fail it under ``OTEL_SWA_REQUIRE_VLLM=1``."""
    if os.environ.get(REQUIRE_VLLM, "").strip() == "1":
        pytest.fail(f"{REQUIRE_VLLM}=1 but {reason}")
    pytest.skip(f"{reason}; run .ci/vllm-tests.sh")


def load_vllm() -> SimpleNamespace:
    """vLLM's classes used by the tests, imported now (about 5-15 s the first time)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # set before huggingface_hub is imported
    try:
        from importlib.metadata import version

        import torch
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            SlidingWindowSpec,
        )
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager
    except Exception as exc:  # vLLM's import chain raises more than ImportError when it breaks
        unavailable(f"vLLM does not import here ({exc!r})")
    init_none_hash(sha256)
    return SimpleNamespace(**{name: value for name, value in locals().items() if name not in ("exc",)},
                           vllm_version=version("vllm"))


@pytest.fixture(scope="session")
def vllm_classes() -> SimpleNamespace:
    """vLLM's real classes (a namespace); see :func:`load_vllm`."""
    return load_vllm()


def vllm_source_dir() -> Path:
    """The installed ``vllm`` package directory, found without importing vLLM (skip or fail as
    :func:`unavailable` when it is not installed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        unavailable("vLLM is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def write_tiny_llama(directory: Path, max_model_len: int) -> Path:
    """A two-layer Llama ``config.json`` (no weights) in ``directory``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": len(LAYERS), "vocab_size": 1024, "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def hybrid_kv_cache_config(v: SimpleNamespace, *, num_blocks: int, block_size: int, window: int,
                           extra_retained_tokens: int = 0):
    """A ``KVCacheConfig``: group 0 full attention (layer 0), group 1 sliding window (layer 1)."""
    import torch

    full = v.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float16)
    swa = v.SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float16,
                              sliding_window=window, extra_retained_tokens=extra_retained_tokens)
    page = full.page_size_bytes
    return v.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[v.KVCacheTensor(size=2 * page * num_blocks, layers=list(LAYERS), layer_stride=page,
                                          block_stride=2 * page)],
        kv_cache_groups=[v.KVCacheGroupSpec([LAYERS[0]], full), v.KVCacheGroupSpec([LAYERS[1]], swa)],
    )


def swa_manager(v: SimpleNamespace, kv_cache_manager) -> object:
    """The sliding-window group's ``SlidingWindowManager`` of a ``KVCacheManager``."""
    managers = kv_cache_manager.coordinator.single_type_managers
    found = [m for m in managers if isinstance(m, v.SlidingWindowManager)]
    assert len(found) == 1, [type(m).__name__ for m in managers]
    return found[0]


def recount(manager, request_ids, num_tokens) -> tuple[int, int, int]:
    """``(FULL tokens, tokens in real SWA blocks, tokens in null SWA blocks)`` of a batch, position
    by position over ``manager.req_to_blocks`` (``KVCacheBlock.is_null``, with ``block_id == 0``
    checked to agree)."""
    full = held = out = 0
    bs = manager.block_size
    for rid, n in zip(request_ids, num_tokens):
        blocks = manager.req_to_blocks[rid] if rid in manager.req_to_blocks else []
        for position in range(n):
            block = blocks[position // bs]
            assert block.is_null == (block.block_id == 0), block
            full += 1
            if block.is_null:
                out += 1
            else:
                held += 1
    return full, held, out
