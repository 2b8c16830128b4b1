"""The persistent decode kernel (sluice.model.persistent_decode): every layer of a small decode
step in one launch gives what the layer-by-layer kernels give, hidden states and KV caches, and
declines the steps it does not serve. Under the interpreter (CPU) its grid is one program."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.attention.metadata import AttentionMetadata
from sluice.attention.triton_backend import TritonBackend
from sluice.model import persistent_decode
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.worker.compile import install_fused_ops
from tests.kernels.test_fused_ops import (  # noqa: F401 (the fixture is autouse)
    DEVICE,
    bfloat16_casts_round_to_nearest,
    build_tiny_model,
)

BLOCK_SIZE = 4
BLOCKS_PER_REQUEST = 16  # 64 tokens a request


def step_metadata(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """Request i owns blocks [i * BLOCKS_PER_REQUEST, ...); a request of seq_len 0 is padding
    (one query token, slot -1), as a decode graph pads its rows."""
    slots: list[int] = []
    for req, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if seq_len == 0:
            slots += [-1] * query_len
        else:
            slots += [req * BLOCKS_PER_REQUEST * BLOCK_SIZE + p
                      for p in range(seq_len - query_len, seq_len)]
    query_start_loc = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32)
    block_tables = torch.arange(len(seq_lens) * BLOCKS_PER_REQUEST, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens_tensor.to(DEVICE),
        block_tables=block_tables.view(len(seq_lens), -1).to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_tensor)


PROMPTS = [21, 9, 30, 17]
# (requests decoding, padding rows): 3 + 1 rows (tensor-core dots), 2 (multiply-adds), 1, and
# 4 + 4 (tensor-core dots over 8 rows).
DECODE_STEPS = [(3, 1), (2, 0), (1, 0), (4, 4)]


def run_steps(model: torch.nn.Module, dtype: torch.dtype
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A prefill of PROMPTS into a fresh cache, then DECODE_STEPS: each step's hidden states of
    its real rows, and every layer's cache at the end."""
    config = model.config
    shape = (2, len(PROMPTS) * BLOCKS_PER_REQUEST, BLOCK_SIZE, config.num_key_value_heads,
             config.head_dim)
    kv_caches = {name: torch.zeros(shape, dtype=dtype, device=DEVICE)
                 for name in attention_layers(model)}
    bind_kv_caches(model, kv_caches)
    generator = torch.Generator().manual_seed(3)
    seq_lens = list(PROMPTS)
    hiddens = []
    with torch.no_grad():
        ids = torch.randint(0, config.vocab_size, (sum(PROMPTS),), generator=generator)
        positions = torch.cat([torch.arange(n) for n in PROMPTS])
        hiddens.append(model(ids.to(DEVICE), positions.to(DEVICE),
                             step_metadata(PROMPTS, PROMPTS)))
        for num_reqs, num_padding in DECODE_STEPS:
            positions = torch.tensor(seq_lens[:num_reqs] + [0] * num_padding)
            for i in range(num_reqs):
                seq_lens[i] += 1
            ids = torch.randint(0, config.vocab_size, (num_reqs + num_padding,),
                                generator=generator)
            metadata = step_metadata([1] * (num_reqs + num_padding),
                                     seq_lens[:num_reqs] + [0] * num_padding)
            hidden = model(ids.to(DEVICE), positions.to(DEVICE), metadata)
            hiddens.append(hidden[:num_reqs])
    return hiddens, list(kv_caches.values())


def build(model_type: str, dtype: torch.dtype, persistent: bool) -> torch.nn.Module:
    model, _ = build_tiny_model(model_type, TritonBackend())
    model.to(dtype)
    install_fused_ops(model, persistent_decode=persistent)
    return model


def count_runs(model: torch.nn.Module, monkeypatch) -> list[bool]:
    """What each call of the model's persistent op returned."""
    op = model.model.decode_layers_op
    assert op is not None
    results: list[bool] = []

    def counted(*args) -> bool:
        results.append(op(*args))
        return results[-1]

    monkeypatch.setattr(model.model, "decode_layers_op", counted)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_persistent_decode_gives_the_layer_by_layer_hidden_states_and_caches(
        monkeypatch, model_type, dtype):
    """Decode steps of 1 to 8 rows (padding rows included) through the one kernel: hidden
    states and caches as the layer-by-layer kernels leave them; contexts over several
    attention tiles in 3 splits, the last one holding the new key."""
    monkeypatch.setattr(persistent_decode, "ATTN_BLOCK_N", 16)
    monkeypatch.setattr(persistent_decode, "choose_num_splits", lambda *args: 3)
    expected = run_steps(build(model_type, dtype, persistent=False), dtype)
    model = build(model_type, dtype, persistent=True)
    runs = count_runs(model, monkeypatch)
    got = run_steps(model, dtype)
    assert runs == [False] + [True] * len(DECODE_STEPS)  # the prefill declined
    if dtype == torch.float32:
        for actual, reference in zip(got[0] + got[1], expected[0] + expected[1], strict=True):
            torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5)
        return
    # bfloat16: float32 sums in another order move roundings by an ulp, and an ulp of the
    # residual moves most of the final norm's outputs (30-70% of the values differ by 1-2
    # ulps). So both are held to the same weights in float32: the one kernel is as close to
    # them as the layer-by-layer kernels are.
    truth_model = build(model_type, dtype, persistent=False).to(torch.float32)
    truth = run_steps(truth_model, torch.float32)
    for actual, reference, exact in zip(got[0] + got[1], expected[0] + expected[1],
                                        truth[0] + truth[1], strict=True):
        error = (actual.float() - exact).abs().max().item()
        reference_error = (reference.float() - exact).abs().max().item()
        assert error <= 1.5 * reference_error + 2**-8, (error, reference_error)
    for actual, reference in zip(got[1], expected[1]):  # caches: mostly the same bits
        assert (actual != reference).float().mean() < 0.03


def test_persistent_decode_declines_what_it_does_not_serve(monkeypatch):
    """Prompts, steps of more than MAX_ROWS rows, steps with a connector's layer hooks and an
    8-bit cache run the layers one by one, with the same hidden states."""
    dtype = torch.float32
    model = build("qwen3", dtype, persistent=True)
    runs = count_runs(model, monkeypatch)
    run_steps(model, dtype)
    assert runs == [False] + [True] * len(DECODE_STEPS)
    op = persistent_decode.PersistentDecode(model.model)
    config = model.config
    rows = persistent_decode.MAX_ROWS + 1
    residual = torch.zeros(rows, config.hidden_size, device=DEVICE)
    positions = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    assert not op.run(residual, positions, step_metadata([1] * rows, [1] * rows))
    assert not op.run(residual[:2], positions[:2], step_metadata([2], [2]))

    class Hooks:
        def wait_for_layer_load(self, layer_name: str) -> None: ...
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata) -> None: ...

    metadata = step_metadata([1], [1])
    metadata.kv_hooks = Hooks()
    assert not op.run(residual[:1], positions[:1], metadata)
    fp8 = {name: torch.zeros(2, 4, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                             dtype=torch.float8_e4m3fn, device=DEVICE)
           for name in attention_layers(model)}
    bind_kv_caches(model, fp8)
    assert not op.run(residual[:1], positions[:1], step_metadata([1], [1]))
    assert torch.equal(residual, torch.zeros_like(residual))


def test_persistent_decode_refuses_models_it_cannot_run():
    """A bias on the projections (Qwen2) keeps its norms unfolded, so no persistent op; a layer
    of another shape is refused with a message."""
    from sluice.attention.torch_ref import TorchRefBackend
    from sluice.model.hf_config import parse_hf_config
    from sluice.model.registry import get_model_class
    from tests.kernels.test_fused_ops import TINY_CONFIG

    config = parse_hf_config({**TINY_CONFIG, "architectures": ["Qwen2ForCausalLM"],
                              "model_type": "qwen2"})
    with torch.device(DEVICE):
        qwen2 = get_model_class(config.architectures)(config, TorchRefBackend())
    install_fused_ops(qwen2)
    assert qwen2.model.decode_layers_op is None
    with pytest.raises(ValueError, match="bias"):
        persistent_decode.PersistentDecode(qwen2.model)
