"""Token constraints in the sampler, built by the runner's metadata path from the step message:
grammar masks constrain exactly their rows (greedy, random, fused kernel), logit_bias moves
sampling but not the raw logprobs."""

from __future__ import annotations

# The fused kernel runs in Triton's interpreter without a GPU (chosen before triton loads).
import tests.kernels.conftest  # noqa: F401

# isort: split
import numpy as np
import pytest
import torch

from sluice.core.outputs import GrammarBitmask
from sluice.sample.sampler import Sampler
from sluice.sampling_params import SamplingParams
from sluice.worker.input_batch import CachedRequestState
from sluice.worker.sampling_inputs import (
    GrammarStaging,
    SamplingStaging,
    build_row_seeds,
    build_sampling_metadata,
)

VOCAB = 300
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def state(req_id: str, temperature: float, seed: int | None = None,
          **params: object) -> CachedRequestState:
    sampling = SamplingParams(temperature=temperature, seed=seed, **params)
    generator = None if seed is None else torch.Generator(DEVICE).manual_seed(seed)
    return CachedRequestState(req_id=req_id, token_ids=[1, 2, 3], num_prompt_tokens=3,
                              sampling_params=sampling, generator=generator, row=0,
                              num_computed_tokens=3)


def packed(rows: list[set[int]]) -> bytes:
    """GrammarBitmask rows: bit v of row r set for v in rows[r]."""
    words = np.zeros((len(rows), -(-VOCAB // 32)), dtype=np.uint32)
    for r, allowed in enumerate(rows):
        for v in allowed:
            words[r, v // 32] |= np.uint32(1 << (v % 32))
    return words.view(np.int32).tobytes()


def sample(states: list[CachedRequestState], logits: torch.Tensor,
           grammar: GrammarBitmask | None, sampler: Sampler | None = None,
           launch: int = 0) -> tuple[list[int], object]:
    sampler = sampler or Sampler(torch.Generator(DEVICE).manual_seed(launch))
    seeds = build_row_seeds(states, 0, launch) if sampler.use_triton else None
    metadata = build_sampling_metadata(states, SamplingStaging(8, DEVICE), VOCAB, seeds,
                                       grammar, GrammarStaging(8, DEVICE))
    output = sampler(logits.to(DEVICE), metadata)
    return output.sampled_token_ids.tolist(), output


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_grammar_masks_constrain_only_their_rows(fused: bool) -> None:
    allowed_a, allowed_b = {7, 50, 299}, {3, 4}
    def batch() -> list[CachedRequestState]:  # fresh generators: both runs draw alike
        return [state("free-greedy", 0.0), state("a", 0.0), state("free-random", 1.0, seed=1),
                state("b", 1.0)]

    # The message lists its rows in its own order; "b" first.
    grammar = GrammarBitmask(req_ids=["b", "a"], bitmask=packed([allowed_b, allowed_a]))
    for launch in range(20):
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(launch)) * 3
        got, _ = sample(batch(), logits, grammar,
                        Sampler(torch.Generator(DEVICE).manual_seed(0), use_triton=fused),
                        launch)
        free, _ = sample(batch(), logits, None,
                         Sampler(torch.Generator(DEVICE).manual_seed(0), use_triton=fused),
                         launch)
        assert got[0] == free[0] == int(logits[0].argmax())
        assert got[1] == max(allowed_a, key=lambda v: float(logits[1, v]))
        assert got[3] in allowed_b
        assert got[2] == free[2]  # an unconstrained random row draws as it would


def test_a_step_whose_constrained_request_is_not_sampled_is_unconstrained() -> None:
    """A request of the message missing from the sampled rows (its KV failed to load) is
    skipped; the other rows sample freely."""
    states = [state("x", 0.0)]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    got, _ = sample(states, logits, GrammarBitmask(req_ids=["gone"], bitmask=packed([{1}])))
    assert got == [int(logits[0].argmax())]


def test_logit_bias_moves_sampling_but_not_the_raw_logprobs() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    top = [int(t) for t in logits.argmax(dim=-1)]
    states = [state("ban", 0.0, logit_bias={top[0]: -100.0}, logprobs=2),
              state("force", 1.0, logit_bias={11: 100.0}, logprobs=2),
              state("plain", 0.0, logprobs=2)]
    got, output = sample(states, logits, None)
    assert got[0] != top[0] and got[0] == int(logits[0].topk(2).indices[1])
    assert got[1] == 11
    assert got[2] == top[2]
    raw = torch.log_softmax(logits, dim=-1)
    # The sampled token's logprob comes first: the model's own, bias or not.
    for row, token in enumerate(got):
        assert float(output.logprobs[row, 0]) == pytest.approx(float(raw[row, token]),
                                                               abs=1e-5)
        assert output.logprob_token_ids[row, 1] == top[row]  # top-1 of the raw distribution


def test_logit_bias_and_a_grammar_together() -> None:
    """The bias acts within the grammar: it cannot bring back a masked token."""
    logits = torch.zeros(1, VOCAB)
    states = [state("g", 0.0, logit_bias={5: 100.0, 9: 50.0})]
    got, _ = sample(states, logits, GrammarBitmask(req_ids=["g"], bitmask=packed([{9, 10}])))
    assert got == [9]
