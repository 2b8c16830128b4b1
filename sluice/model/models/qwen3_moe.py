"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, 235B-A22B): the Qwen3 decoder (q/k norms per
head) whose MLP is a mixture of experts (sluice.model.moe) in every layer that
`decoder_sparse_step` and `mlp_only_layers` leave sparse, a dense SwiGLU MLP in the others. No
shared experts (Qwen2-MoE's), no router bias."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.hf_config import HFModelConfig
from sluice.model.loader import load_packed_weights
from sluice.model.models.qwen3 import Qwen3ForCausalLM
from sluice.model.moe import FusedMoE, load_experts
from sluice.model.weights import LoadedWeight


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # An FP8 checkpoint's experts stay FP8 where its projections do (prepare_fp8_experts).
    @staticmethod
    def mlp_builder(config: HFModelConfig, tp: TPGroup = SINGLE_RANK
                    ) -> Callable[[int], nn.Module | None] | None:
        moe = config.moe
        if moe is None:
            raise ValueError(f"a {config.architectures[0] if config.architectures else 'MoE'} "
                             f"config must name its experts (model_type 'qwen3_moe' or "
                             f"'mixtral', got {config.model_type!r})")
        return lambda i: None if i in moe.dense_layers else FusedMoE(config.hidden_size, moe, tp)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        skip = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        rest, experts = load_experts(self, weights)
        load_packed_weights(self, rest, self.packed_modules, skip, loaded_elsewhere=experts)
