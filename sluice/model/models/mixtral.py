"""Mixtral (`MixtralForCausalLM`: Mixtral 8x7B, 8x22B): the Mistral decoder whose every MLP is a
mixture of `num_local_experts` SwiGLU experts of `intermediate_size`, `num_experts_per_tok` a
token, weighted by the softmax of the router's top logits (the softmax over all experts, its
top k renormalized: the same weights). The checkpoint names them
`block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate / up / down) and `block_sparse_moe.gate`
(the router); they are read as sluice.model.moe's experts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sluice.model.models.mistral import MistralForCausalLM
from sluice.model.models.qwen3_moe import Qwen3MoeForCausalLM
from sluice.model.weights import LoadedWeight

_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def sluice_weight_name(name: str) -> str:
    """A Mixtral tensor name -> the one sluice.model.moe reads ('mlp.experts.{e}.gate_proj')."""
    if ".block_sparse_moe." in name:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        head, sep, tail = name.partition(".experts.")
        if sep:
            index, _, rest = tail.partition(".")
            part, dot, suffix = rest.partition(".")
            if part in _PARTS and dot:
                name = f"{head}.experts.{index}.{_PARTS[part]}.{suffix}"
    return name


def _checkpoint_names(weights: Iterable[tuple[str, LoadedWeight]]
                      ) -> Iterator[tuple[str, LoadedWeight]]:
    for name, tensor in weights:
        yield sluice_weight_name(name), tensor


class MixtralForCausalLM(MistralForCausalLM):
    mlp_builder = staticmethod(Qwen3MoeForCausalLM.mlp_builder)
    # the FP8 experts' names (sluice.model.moe.prepare_fp8_experts)
    sluice_weight_name = staticmethod(sluice_weight_name)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        Qwen3MoeForCausalLM.load_weights(self, _checkpoint_names(weights))
