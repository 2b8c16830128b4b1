"""sluice's models give HF's logits, whatever way the tokens are batched through the paged cache.

Each tiny HF model is saved with `save_pretrained`, loaded back with sluice's loader, and run
through a paged KV cache with shuffled, non-contiguous blocks: one prefill batch, chunked
prefill reading a cached prefix, and one-token decode steps.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch import nn

from sluice.attention.kv_layout import allocate_kv_caches
from sluice.attention.metadata import AttentionMetadata
from sluice.attention.torch_ref import TorchRefBackend
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import HFModelConfig, load_hf_config
from sluice.model.loader import load_model
from tests.tiny_models import build_hf_model

VOCAB_SIZE = 300

# name -> (arch, config fields beyond tests/tiny_models.py's shape)
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "llama_llama3_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
        },
    ),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "mistral_head_dim_apart": ("mistral", {"head_dim": 32, "sliding_window": None}),
    "phi3_fused_qkv_gate_up": ("phi3", {}),
    # every layer sparse, the top 3 of 6 experts not renormalized
    "qwen3_moe_unnormalized": ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 3,
                                             "norm_topk_prob": False, "mlp_only_layers": []}),
    "qwen3_moe_dense_layer": ("qwen3_moe", {}),
    # every layer sparse with the shared expert, the top 3 of 6 renormalized, no q/k/v bias
    "qwen2_moe_all_sparse": ("qwen2_moe", {"num_experts": 6, "num_experts_per_tok": 3,
                                           "norm_topk_prob": True, "mlp_only_layers": [],
                                           "qkv_bias": False}),
    "qwen2_moe_dense_layer": ("qwen2_moe", {}),
    "mixtral_top3_windowed": ("mixtral", {"num_experts_per_tok": 3, "sliding_window": 8}),
    "gemma3_softcapped": ("gemma3", {"final_logit_softcapping": 5.0}),
}

PROMPT_LENS = [13, 6, 21]


def make_hf_model(variant: str, model_dir: Path, **save_kwargs) -> nn.Module:
    """A random tiny HF model saved to `model_dir`. Weights are redrawn wider than HF's init
    (and norms/biases away from 1/0) so a misplaced tensor moves the logits visibly."""
    arch, extra = VARIANTS[variant]
    hf_model = build_hf_model(arch, seed=0, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                              **extra)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    hf_model.save_pretrained(model_dir, **save_kwargs)
    return hf_model


def make_prompts(seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist()
        for n in PROMPT_LENS
    ]


def hf_logits(hf_model: nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()  # [len, vocab]


class PagedRunner:
    """A stand-in for the model runner: per-request block tables drawn from a shuffled free
    list as tokens arrive, metadata built for each step."""

    def __init__(
        self, model: nn.Module, config: HFModelConfig, block_size: int, num_blocks: int = 64
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(list(attention_layers(model)), num_blocks,
                                            block_size, config.num_key_value_heads,
                                            config.head_dim, torch.float32, torch.device("cpu"))
        bind_kv_caches(model, self.kv_caches)
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))
        self.free_blocks = self.free_blocks.tolist()
        self.block_tables: dict[int, list[int]] = defaultdict(list)
        self.num_computed: dict[int, int] = defaultdict(int)

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute `chunks[req]` (the next tokens of each request); logits [len, vocab] each."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens = [0], []
        for req, tokens in chunks.items():
            start = self.num_computed[req]
            end = start + len(tokens)
            table = self.block_tables[req]
            for pos in range(start, end):
                if pos // self.block_size == len(table):
                    table.append(self.free_blocks.pop())
                positions.append(pos)
                block_id, offset = table[pos // self.block_size], pos % self.block_size
                slots.append(block_id * self.block_size + offset)
            input_ids += tokens
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            seq_lens.append(end)
            self.num_computed[req] = end
        width = max(len(self.block_tables[req]) for req in chunks)
        block_tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, req in enumerate(chunks):
            block_tables[i, : len(self.block_tables[req])] = torch.tensor(self.block_tables[req])
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), metadata)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return {
            req: logits[query_start_loc[i] : query_start_loc[i + 1]]
            for i, req in enumerate(chunks)
        }


def load_sluice_model(model_dir: Path) -> tuple[nn.Module, HFModelConfig]:
    config = load_hf_config(str(model_dir))
    cpu = torch.device("cpu")
    model = load_model(str(model_dir), config, torch.float32, cpu, TorchRefBackend())
    return model, config


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf_model(request.param, model_dir)
    prompts = make_prompts()
    expected = [hf_logits(hf_model, p) for p in prompts]
    model, config = load_sluice_model(model_dir)
    return request.param, model, config, prompts, expected


def assert_logits_match(got: dict[int, list[torch.Tensor]], expected: list[torch.Tensor]) -> None:
    for req, reference in enumerate(expected):
        torch.testing.assert_close(torch.cat(got[req]), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [4, 8])
def test_single_prefill_batch_matches_hf(variant, block_size):
    _, model, config, prompts, expected = variant
    runner = PagedRunner(model, config, block_size)
    got = runner.step(dict(enumerate(prompts)))
    assert_logits_match({req: [logits] for req, logits in got.items()}, expected)


def test_chunked_prefill_reading_cached_prefix_matches_hf(variant):
    _, model, config, prompts, expected = variant
    runner = PagedRunner(model, config, block_size=4)
    got: dict[int, list[torch.Tensor]] = defaultdict(list)
    # Step 1: first chunks of requests 0 and 1 (ending mid-block); step 2: their rest plus all
    # of request 2; step 3: request 2 is not done in step 2, so a third chunk tops it up.
    steps = [
        {0: prompts[0][:5], 1: prompts[1][:1]},
        {0: prompts[0][5:], 1: prompts[1][1:], 2: prompts[2][:10]},
        {2: prompts[2][10:]},
    ]
    for chunks in steps:
        for req, logits in runner.step(chunks).items():
            got[req].append(logits)
    assert_logits_match(got, expected)


def test_decode_steps_match_hf(variant):
    _, model, config, prompts, expected = variant
    runner = PagedRunner(model, config, block_size=4)
    got: dict[int, list[torch.Tensor]] = defaultdict(list)
    # Prefill all but the last few tokens, then feed one token per request per step; requests
    # leave the batch at different steps.
    num_decode = [5, 1, 9]
    prefill = {req: p[: len(p) - n] for req, (p, n) in enumerate(zip(prompts, num_decode))}
    for req, logits in runner.step(prefill).items():
        got[req].append(logits)
    for step in range(max(num_decode)):
        chunks = {
            req: [p[len(p) - n + step]]
            for req, (p, n) in enumerate(zip(prompts, num_decode))
            if step < n
        }
        for req, logits in runner.step(chunks).items():
            assert logits.shape == (1, VOCAB_SIZE)
            got[req].append(logits)
    assert_logits_match(got, expected)


def test_tied_embeddings_share_one_tensor(variant):
    name, model, config, _, _ = variant
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert config.tie_word_embeddings == (name == "llama_tied" or name.startswith("gemma3"))
    assert tied == config.tie_word_embeddings


def test_loaded_layers_are_named_and_bound_by_name(variant):
    _, model, config, _, _ = variant
    names = [f"model.layers.{i}.self_attn.attn" for i in range(config.num_hidden_layers)]
    assert [layer.layer_name for layer in attention_layers(model).values()] == names
    # Keys in reverse order: each layer still gets the tensor of its own name.
    caches = {name: torch.zeros(2, 1, 4, config.num_key_value_heads, config.head_dim)
              for name in reversed(names)}
    bind_kv_caches(model, caches)
    for name, layer in attention_layers(model).items():
        assert layer.kv_cache is caches[name]


def test_bind_kv_caches_names_missing_and_extra_layers(variant):
    _, model, config, _, _ = variant
    shape = (2, 1, 4, config.num_key_value_heads, config.head_dim)
    caches = {"model.layers.0.self_attn.attn": torch.zeros(shape),
              "model.layers.9.self_attn.attn": torch.zeros(shape)}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.attn'\], "
                                         r"extra \['model.layers.9.self_attn.attn'\]"):
        bind_kv_caches(model, caches)
