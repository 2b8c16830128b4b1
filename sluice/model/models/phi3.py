"""Phi-3 (`Phi3ForCausalLM`): the Llama decoder with q/k/v stored as one fused `qkv_proj` weight
and gate/up as one `gate_up_proj` weight, split at load into the merged layers' shards (so a
tensor-parallel rank reads its rows of each part, as for separate tensors). RoPE over the whole
head only (`partial_rotary_factor` other than 1 and the `longrope` scaling of the 128k models
are refused by sluice.model.hf_config); a sliding window on every layer, as for Mistral."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sluice.model.loader import load_packed_weights
from sluice.model.models.llama import LlamaForCausalLM
from sluice.model.weights import LoadedWeight, RowSlice


class Phi3ForCausalLM(LlamaForCausalLM):
    # The fused tensors are split by rows here, not read as FP8 layers (prepare_fp8_layers).
    fp8_weights = False

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        skip = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        load_packed_weights(self, self._split_fused(weights), self.packed_modules, skip)

    def _split_fused(self, weights: Iterable[tuple[str, LoadedWeight]]
                     ) -> Iterator[tuple[str, LoadedWeight]]:
        config = self.config
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        for name, tensor in weights:
            if name.endswith(".self_attn.qkv_proj.weight"):
                parts = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
                total = q + 2 * kv
            elif name.endswith(".mlp.gate_up_proj.weight"):
                parts = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
                total = 2 * inter
            else:
                yield name, tensor
                continue
            if tensor.shape[0] != total:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the "
                                 f"config's heads and sizes make {total}")
            fused = name.rsplit(".", 2)[-2]  # qkv_proj / gate_up_proj
            for part, (start, rows) in parts.items():
                yield name.replace(f".{fused}.", f".{part}."), RowSlice(tensor, start, rows)
