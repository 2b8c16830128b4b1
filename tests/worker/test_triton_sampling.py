"""The fused sampling kernels: greedy rows equal torch.argmax (ties to the lowest index, across
chunks), random rows equal the documented two-level Philox race (checked against a numpy
rendering of it, whose draws follow softmax(logits / T) and never pick a -inf token), seeded
requests draw the same tokens whatever their batch, and the Sampler takes the kernel exactly for
the rows that need nothing but temperature or greedy.

Without a GPU the kernels run in Triton's interpreter (set up by tests/kernels/conftest.py,
imported first), so shapes stay tiny and small blocks stand in for the 4096-column chunks.
"""

from __future__ import annotations

# Triton reads TRITON_INTERPRET when it defines kernels, its own (tl.cdiv, tl.randint4x) included,
# so the interpreter is chosen before triton is first imported.
import tests.kernels.conftest  # noqa: F401

# isort: split
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from sluice import LLM, SamplingParams
from sluice.core.outputs import GrammarBitmask
from sluice.sample.metadata import SamplingMetadata
from sluice.sample.sampler import Sampler, SamplerOutput
from sluice.sample.triton_sampling import MAX_VOCAB, _neg_log2_uniform, sample_tokens
from sluice.worker.input_batch import CachedRequestState
from sluice.worker.sampling_inputs import (
    SamplingMetadataReuse,
    SamplingStaging,
    build_row_seeds,
    build_sampling_metadata,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")
LOG2_E = math.log2(math.e)
_MASK32 = np.uint64(0xFFFFFFFF)


# ---- a numpy rendering of the kernel's race -------------------------------------------------

def philox4x32(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Philox4x32-10 (Salmon et al., SC'11) of counter (c, 0, 0, 0) under the 64-bit key split
    into (low, high) words. keys: [B] uint64, counters: [V] -> the four words [4, B, V]."""
    keys = keys.astype(np.uint64)[:, None]
    k0, k1 = keys & _MASK32, keys >> np.uint64(32)
    c0 = np.broadcast_to(counters.astype(np.uint64)[None, :], (keys.shape[0], len(counters)))
    c1 = c2 = c3 = np.zeros_like(c0)
    for _ in range(10):
        p0, p2 = c0 * np.uint64(0xD2511F53), c2 * np.uint64(0xCD9E8D57)
        c0, c1, c2, c3 = ((p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & _MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK32)
        k0 = (k0 + np.uint64(0x9E3779B9)) & _MASK32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _MASK32
    return np.stack([c0, c1, c2, c3])


def neg_log2_uniform(bits: np.ndarray) -> np.ndarray:
    """The kernel's -log2(u) = E / ln 2 from 32 random bits, in float32 (see
    triton_sampling._neg_log2_uniform)."""
    k = (bits >> np.uint64(9)).astype(np.float32)
    u = (k + np.float32(0.5)) * np.float32(2.0**-23)
    w = (np.float32(8388607.5) - k) * np.float32(2.0**-23)
    series = w * (np.float32(1.0) + w * (np.float32(0.5) + w * np.float32(1.0 / 3.0)))
    return np.where(w < np.float32(2.0**-7), series * np.float32(LOG2_E), -np.log2(u))


def reference_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                   block: int) -> torch.Tensor:
    """[B] tokens: argmax of the logits (greedy rows); for random rows, the chunk c* of `block`
    columns that maximises log2 S_c + log2(e) * (-ln E_c) (S_c the chunk's softmax mass, its E
    from the first word of Philox at counter 2^30 + c), then argmax over c*'s columns of
    log2(e) * (logits / T - ln E), column v's E from word (v % block) // (block / 4) of Philox
    at counter v // block * block + v % (block / 4). Chunk masses in float64."""
    x = logits.cpu().float().numpy()
    num_rows, vocab_size = x.shape
    quarter = block // 4
    cols = np.arange(vocab_size)
    keys = seeds.cpu().numpy().view(np.uint64)
    words = philox4x32(keys, cols // block * block + cols % quarter)
    bits = np.take_along_axis(words, np.broadcast_to(((cols % block) // quarter)[None, None, :],
                                                     (1, num_rows, vocab_size)), axis=0)[0]
    t = temperature.cpu().numpy().astype(np.float32)[:, None]
    greedy = t[:, 0] < 1e-5
    scale = np.float32(LOG2_E) / np.where(greedy[:, None], np.float32(1.0), t)
    col_scores = x * scale - np.log2(neg_log2_uniform(bits))
    num_chunks = -(-vocab_size // block)
    y = np.full((num_rows, num_chunks * block), -np.inf)
    y[:, :vocab_size] = x.astype(np.float64) * scale
    y = y.reshape(num_rows, num_chunks, block)
    peak = y.max(axis=-1)
    with np.errstate(invalid="ignore"):
        mass = np.exp2(y - peak[..., None]).sum(axis=-1)
    weight = np.where(np.isneginf(peak), -np.inf, peak + np.log2(mass))
    chunk_bits = philox4x32(keys, MAX_VOCAB + np.arange(num_chunks))[0]
    chosen = (weight - np.log2(neg_log2_uniform(chunk_bits))).argmax(axis=-1)
    tokens = []
    for row in range(num_rows):
        if greedy[row]:
            tokens.append(int(x[row].argmax()))  # first maximum: the lowest index
            continue
        start = int(chosen[row]) * block
        tokens.append(start + int(col_scores[row, start : start + block].argmax()))
    return torch.tensor(tokens)


def chi_square_bound(dof: int, z: float = 4.753) -> float:
    """Upper 1e-6 quantile of chi-square(dof), Wilson-Hilferty (z: the normal 1e-6 quantile)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over bins expecting at least 5 draws (the others pooled into one)."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


# ---- batches as the runner builds them -------------------------------------------------------

def make_state(index: int, seed: int | None = None, temperature: float = 1.0,
               num_sampled: int = 0, **params: object) -> CachedRequestState:
    return CachedRequestState(
        req_id=f"r{index}", token_ids=[1, 2, 3], num_prompt_tokens=3,
        sampling_params=SamplingParams(temperature=temperature, seed=seed, **params),
        generator=None, row=index, num_computed_tokens=3, num_sampled=num_sampled)


def seeds_of(num_rows: int, base_seed: int = 0, launch: int = 0) -> torch.Tensor:
    states = [make_state(i) for i in range(num_rows)]
    return torch.from_numpy(build_row_seeds(states, base_seed, launch))


def random_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed))


# ---- greedy ----------------------------------------------------------------------------------

def tie_rows(vocab_size: int, block: int) -> torch.Tensor:
    """Rows whose maximum is repeated: in two chunks, on both sides of a chunk boundary, in two
    quarters where the lower column sits in the higher lane, and in the partial last chunk; an
    all -inf row; rows all -inf but for one column of the partial last chunk."""
    quarter = block // 4
    rows = random_logits(7, vocab_size, seed=5).clamp(max=3.0)
    for row, cols in enumerate([(10, block + 50), (block - 1, block), (quarter + 1, 2),
                                (vocab_size - 1, 3 * block + 7)]):
        rows[row, list(cols)] = 9.0
    rows[4] = NEG_INF
    rows[5] = NEG_INF
    rows[5, vocab_size - 2] = -100.0
    rows[6, : vocab_size - 1] = NEG_INF
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_equal_torch_argmax(dtype: torch.dtype) -> None:
    block, vocab_size = 64, 300  # 5 chunks, the last one partial
    logits = torch.cat([random_logits(3, vocab_size, seed=4), tie_rows(vocab_size, block)])
    logits[1, ::7] = NEG_INF
    logits = logits.to(dtype).to(DEVICE)
    sampled = sample_tokens(logits, torch.zeros(len(logits), device=DEVICE),
                            seeds_of(len(logits)).to(DEVICE), block=block)
    assert sampled.dtype == torch.int64
    assert sampled.tolist() == logits.argmax(dim=-1).tolist()
    assert sampled[3:7].tolist() == [10, block - 1, 2, 3 * block + 7]


def test_greedy_ties_across_chunks_take_the_lowest_index() -> None:
    block, vocab_size = 32, 160
    logits = torch.zeros(3, vocab_size)
    logits[0, [31, 32]] = 1.0
    logits[1, [40, 100, 159]] = 2.0
    logits[2, [159]] = 3.0
    sampled = sample_tokens(logits.to(DEVICE), torch.zeros(3, device=DEVICE),
                            seeds_of(3).to(DEVICE), block=block)
    assert sampled.tolist() == [31, 40, 159]


# ---- random rows -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_and_greedy_rows_of_one_batch(dtype: torch.dtype) -> None:
    block, vocab_size = 64, 300
    logits = random_logits(10, vocab_size, seed=6) * 3
    logits[2, 150:] = NEG_INF
    logits = logits.to(dtype).to(DEVICE)
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 2.0, 1e-6, 0.3, 1.0, 1.0, 5.0])
    seeds = seeds_of(10, base_seed=3, launch=1)
    sampled = sample_tokens(logits, temperature.to(DEVICE), seeds.to(DEVICE), block=block)
    assert sampled.tolist() == reference_race(logits, temperature, seeds, block).tolist()
    greedy = (temperature < 1e-5).nonzero().flatten().tolist()
    assert sampled[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()
    assert sampled[2] < 150


# block 32: one chunk (the column race alone); block 4: two chunks (the chunk race, then the
# columns of the chunk it picks).
@pytest.mark.parametrize(("temperature", "block"), [(0.5, 32), (1.0, 32), (2.0, 32),
                                                    (0.5, 4), (1.0, 4), (2.0, 4)])
def test_random_rows_draw_from_softmax_of_logits_over_temperature(temperature: float,
                                                                   block: int) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, NEG_INF])
    num_rows = 6000
    seeds = seeds_of(num_rows, base_seed=11 + block, launch=int(temperature * 10))
    all_rows = logits.expand(num_rows, -1)
    temperatures = torch.full((num_rows,), temperature)
    drawn = reference_race(all_rows, temperatures, seeds, block)
    # The kernel is the race: equal draws on a slice of the rows. (On a GPU it draws for all
    # rows, whose counts are checked too: its float rounding may flip a rare near-tie.)
    num_kernel_rows = num_rows if DEVICE == "cuda" else 48
    sampled = sample_tokens(all_rows[:num_kernel_rows].to(DEVICE),
                            temperatures[:num_kernel_rows].to(DEVICE),
                            seeds[:num_kernel_rows].to(DEVICE), block=block).cpu()
    assert sampled[:48].tolist() == drawn[:48].tolist()

    probs = torch.softmax(logits / temperature, dim=-1).double().numpy()
    wrong = torch.softmax(logits / (2 * temperature), dim=-1).double().numpy()
    for draws in [drawn] + ([sampled] if DEVICE == "cuda" else []):
        counts = np.bincount(draws.numpy(), minlength=8)
        assert counts[7] == 0
        stat, dof = chi_square(counts, probs)
        assert stat < chi_square_bound(dof), (counts, probs * num_rows)
        # A wrong temperature is far outside the bound: the check has power.
        assert chi_square(counts, wrong)[0] > 10 * chi_square_bound(dof)


def test_masked_tokens_are_never_drawn() -> None:
    # The masked columns hold what would be the most likely tokens, at a high temperature.
    block, vocab_size = 64, 200
    logits = torch.linspace(-3, 3, vocab_size).expand(3000, -1).clone()
    allowed = torch.tensor([0, 5, 63, 64, 130, 199])
    masked = torch.ones(vocab_size, dtype=torch.bool)
    masked[allowed] = False
    logits[:, masked] = NEG_INF
    temperature = torch.full((len(logits),), 4.0)
    seeds = seeds_of(len(logits), base_seed=5)
    drawn = reference_race(logits, temperature, seeds, block)
    assert set(drawn.tolist()) == set(allowed.tolist())
    sampled = sample_tokens(logits[:16].to(DEVICE), temperature[:16].to(DEVICE),
                            seeds[:16].to(DEVICE), block=block)
    assert sampled.cpu().tolist() == drawn[:16].tolist()


@triton.jit
def _neg_log2_uniform_kernel(bits_ptr, out_ptr, N: tl.constexpr, FAST_LOG: tl.constexpr):
    offsets = tl.arange(0, N)
    bits = tl.load(bits_ptr + offsets).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + offsets, _neg_log2_uniform(bits, FAST_LOG))


def test_exponentials_stay_finite_and_positive_at_the_extreme_bits() -> None:
    """u = 0 or 1 would give E = inf or 0 (an infinite score: a masked token's -inf + inf is
    nan). Every 32-bit word maps to 0 < u < 1; near u = 1 the series keeps E accurate (on a GPU,
    where the log2 is approximate, as well)."""
    k = np.array([0, 1, 2**22, 2**23 - 2**16 - 1, 2**23 - 2**16, 2**23 - 2**16 + 1,
                  2**23 - 1000, 2**23 - 2, 2**23 - 1], dtype=np.int64)
    words = np.concatenate([k << 9, (k << 9) + 511]).astype(np.uint32)
    padded = np.zeros(32, dtype=np.uint32)
    padded[:len(words)] = words
    bits = torch.from_numpy(padded.view(np.int32)).to(DEVICE)
    out = torch.empty(32, dtype=torch.float32, device=DEVICE)
    _neg_log2_uniform_kernel[(1,)](bits, out, N=32, FAST_LOG=DEVICE == "cuda")
    exponentials = out.cpu().double().numpy()[:len(words)] / LOG2_E
    u = (np.concatenate([k, k]) + 0.5) / 2.0**23
    assert np.all(np.isfinite(exponentials)) and np.all(exponentials > 0)
    # (5e-5 allows an approximate log2 away from u = 1; near it the error would be ~100%.)
    np.testing.assert_allclose(exponentials, -np.log(u), rtol=5e-5)
    assert exponentials.max() < 17 and exponentials.min() > 5e-8


# ---- seeds -----------------------------------------------------------------------------------

def test_same_seeds_give_the_same_tokens_and_other_seeds_others() -> None:
    logits = torch.zeros(16, 300, device=DEVICE)  # uniform: the token is all noise
    temperature = torch.ones(16, device=DEVICE)
    seeds = seeds_of(16, base_seed=1).to(DEVICE)
    first = sample_tokens(logits, temperature, seeds)
    assert sample_tokens(logits, temperature, seeds).tolist() == first.tolist()
    other = sample_tokens(logits, temperature, seeds_of(16, base_seed=2).to(DEVICE))
    assert sum(a != b for a, b in zip(first.tolist(), other.tolist())) >= 12
    assert len(set(first.tolist())) >= 12  # rows of one launch draw independently


def test_row_seeds_key_a_seeded_request_by_its_seed_and_num_sampled() -> None:
    seeded = make_state(0, seed=1234, num_sampled=3)
    batch_a = [seeded, make_state(1), make_state(2, seed=99)]
    batch_b = [make_state(3), make_state(4, temperature=0.0), make_state(5), seeded]
    keys_a = build_row_seeds(batch_a, base_seed=0, launch=7)
    keys_b = build_row_seeds(batch_b, base_seed=5, launch=12)
    assert keys_a.dtype == np.int64 and keys_a[0] == keys_b[3]
    seeded.num_sampled += 1
    assert build_row_seeds(batch_a, base_seed=0, launch=7)[0] != keys_a[0]
    # Unseeded rows: distinct by row and by launch.
    next_launch = build_row_seeds(batch_b, base_seed=5, launch=13)
    assert len({*keys_a.tolist(), *keys_b.tolist(), *next_launch[:3].tolist()}) == 9
    # Seeds past 64 bits or negative wrap instead of failing.
    assert build_row_seeds([make_state(0, seed=-1), make_state(1, seed=2**70)], 0, 0).shape == (2,)


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch() -> None:
    """Through the real metadata path: the request's row and its batch mates change, its
    tokens do not; its next draw (one more token sampled) differs."""
    staging = SamplingStaging(8, torch.device(DEVICE))
    sampler = Sampler(use_triton=True)
    vocab_size = 300
    seeded = [make_state(10 + i, seed=seed, num_sampled=2) for i, seed in enumerate((21, 22))]
    uniform = torch.zeros(vocab_size)

    def draw(states: list[CachedRequestState], launch: int) -> list[int]:
        """The tokens of `seeded`, sampled in a batch of `states`."""
        rows = [next(i for i, state in enumerate(states) if state is s) for s in seeded]
        logits = random_logits(len(states), vocab_size, seed=launch) * 4
        logits[rows] = uniform
        metadata = build_sampling_metadata(states, staging, vocab_size,
                                           build_row_seeds(states, 0, launch))
        sampled = sampler(logits.to(DEVICE), metadata).sampled_token_ids.tolist()
        return [sampled[row] for row in rows]

    together = draw(seeded, launch=0)
    mixed = draw([make_state(5), seeded[1], make_state(6, temperature=0.0), seeded[0],
                  make_state(7, temperature=0.5)], launch=9)
    assert mixed == together
    for state in seeded:
        state.num_sampled += 1
    assert draw(seeded, launch=0) != together


# ---- the Sampler's choice --------------------------------------------------------------------

@pytest.mark.parametrize("change", [
    {}, {"temperature": 0.0}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1},
    {"presence_penalty": 0.5}, {"logprobs": 2}, {"min_tokens": 10, "stop_token_ids": [7]}])
def test_rows_needing_only_temperature_take_the_kernel_whatever_their_batch(
        change: dict) -> None:
    """Three random rows and a greedy one beside a row changed by `change`: with nothing but
    temperature the kernel samples the batch; otherwise the torch path does (on the bf16 logits
    it upcasts) and the four rows take the kernel's tokens."""
    vocab_size = 300
    states = [make_state(i) for i in range(3)]
    states += [make_state(3, temperature=0.0), make_state(4, **change)]
    logits = (random_logits(5, vocab_size, seed=8) * 2).to(torch.bfloat16).to(DEVICE)
    staging = SamplingStaging(8, torch.device(DEVICE))
    metadata = build_sampling_metadata(states, staging, vocab_size,
                                       build_row_seeds(states, 0, 0))
    fused = Sampler(torch.Generator(DEVICE).manual_seed(0), use_triton=True)
    torch_path = Sampler(torch.Generator(DEVICE).manual_seed(0), use_triton=False)
    out = fused(logits, metadata)
    reference = torch_path(logits, metadata).sampled_token_ids.tolist()
    kernel = sample_tokens(logits, metadata.temperature, metadata.seeds).tolist()
    assert kernel[:3] != reference[:3]  # the paths draw differently: the test can tell them
    whole_batch = change in ({}, {"temperature": 0.0})
    assert fused.uses_fused_kernel(logits, metadata) == whole_batch
    assert not torch_path.uses_fused_kernel(logits, metadata)
    if whole_batch:
        assert metadata.fused_rows is None
        assert out.sampled_token_ids.tolist() == kernel
    else:
        assert metadata.fused_rows.tolist() == [True] * 4 + [False]
        assert out.sampled_token_ids.tolist() == kernel[:4] + reference[4:]
    assert out.sampled_token_ids[3] == logits[3].argmax()
    if "logprobs" in change:  # the logprobs follow the tokens actually sampled
        assert out.logprob_token_ids[:, 0].tolist() == out.sampled_token_ids.tolist()
    # Without row seeds (metadata built as spec decoding builds it) there is no kernel.
    no_seeds = build_sampling_metadata(states, staging, vocab_size)
    assert no_seeds.seeds is None and no_seeds.fused_rows is None
    assert not fused.uses_fused_kernel(logits, no_seeds)
    # By default only CUDA logits take it.
    assert Sampler().uses_fused_kernel(logits, metadata) == (whole_batch and DEVICE == "cuda")


class KeyRecordingSampler(Sampler):
    """The fused sampler, noting each launch's row seeds."""

    def __init__(self) -> None:
        super().__init__(use_triton=True)
        self.launch_seeds: list[list[int]] = []

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        self.launch_seeds.append(metadata.seeds.tolist())
        return super().forward(logits, metadata)


def test_seeded_requests_through_the_engine_with_the_kernel(qwen3_dir: str) -> None:
    """The runner keys a seeded request by its sampled-token count, counted at launch: its
    tokens depend neither on the batch (even one that needs the torch path for another row) nor
    on async scheduling; they are not the torch path's."""
    target = {"prompt_token_ids": list(range(20, 45))}
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=6, ignore_eos=True)
    others = [{"prompt_token_ids": list(range(50, 50 + n))} for n in (3, 30)]
    mixed_params = [SamplingParams(temperature=1.0, seed=7, max_tokens=6), params,
                    SamplingParams(temperature=0.8, top_k=5, max_tokens=8)]
    keys = [int(build_row_seeds([make_state(0, seed=1234, num_sampled=n)], 0, 0)[0])
            for n in range(6)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256, seed=0,
                  async_scheduling=async_scheduling)
        sampler = KeyRecordingSampler()
        llm.llm_engine.engine_core.executor.model_runner.sampler = sampler
        alone = llm.generate([target], params)[0].outputs[0].token_ids
        assert [seeds[0] for seeds in sampler.launch_seeds[:6]] == keys
        batched = llm.generate([others[0], target, others[1]], mixed_params)
        assert batched[1].outputs[0].token_ids == alone
        results.append(alone)
    assert results[0] == results[1]
    torch_path = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256, seed=0)
    torch_path.llm_engine.engine_core.executor.model_runner.sampler.use_triton = False  # (CUDA too)
    assert torch_path.generate([target], params)[0].outputs[0].token_ids != results[0]


# ---- limits and full-size shapes -------------------------------------------------------------

def test_vocabularies_past_the_chunk_counters_are_refused() -> None:
    logits = torch.zeros(1, 1, device=DEVICE).expand(1, MAX_VOCAB)  # no memory behind it
    with pytest.raises(ValueError, match=f"vocabulary size must be below {MAX_VOCAB}, got"):
        sample_tokens(logits, torch.ones(1, device=DEVICE), seeds_of(1).to(DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="full vocabulary: too slow for the interpreter")
@pytest.mark.parametrize("num_rows", [1, 7, 256])
def test_full_vocabulary_on_the_gpu(num_rows: int) -> None:
    vocab_size = 151_936
    logits = (torch.randn(num_rows, vocab_size, device=DEVICE) * 3).to(torch.bfloat16)
    logits[:, ::3] = NEG_INF
    seeds = seeds_of(num_rows).to(DEVICE)
    greedy = torch.zeros(num_rows, device=DEVICE)
    random = torch.ones(num_rows, device=DEVICE)
    assert torch.equal(sample_tokens(logits, greedy, seeds), logits.argmax(dim=-1))
    drawn = sample_tokens(logits, random, seeds)
    # (the numpy race on two rows: its Philox words for all of them would take GBs)
    expected = reference_race(logits[:2], random[:2], seeds[:2], 4096)
    assert drawn[:2].tolist() == expected.tolist()
    assert not (drawn % 3 == 0).any()


@pytest.mark.parametrize("num_rows", [1, 3, 5, 8])
def test_sampling_columns_start_16_byte_aligned(num_rows: int) -> None:
    """Triton compiles a variant per pointer alignment: a column at an odd offset would compile
    one mid-run. Every uploaded column starts on 16 bytes, and holds the values given."""
    staging = SamplingStaging(8, torch.device(DEVICE))
    floats = [[float(c * 10 + r) for r in range(num_rows)] for c in range(6)]
    ints = [[c * 100 + r for r in range(num_rows)] for c in range(3)]
    for _ in range(2):  # both buffer sets
        float_columns, int_columns = staging.upload(floats, ints)
        assert float_columns.tolist() == floats and int_columns.tolist() == ints
        for column in [*float_columns.unbind(0), *int_columns.unbind(0)]:
            assert column.is_contiguous() and column.data_ptr() % 16 == 0


def test_metadata_is_reused_for_the_same_rows_with_new_seeds() -> None:
    staging = SamplingStaging(8, torch.device("cpu"))
    reuse = SamplingMetadataReuse(staging)
    states = [make_state(0, temperature=0.7, top_p=0.9), make_state(1, seed=4)]
    seeds = build_row_seeds(states, 0, 0)
    first = build_sampling_metadata(states, staging, 100, seeds)
    reuse.keep(states, first)
    next_seeds = build_row_seeds(states, 0, 1)
    again = reuse.get(list(states), next_seeds, None)
    assert again is not None and again.temperature is first.temperature
    assert again.top_p is first.top_p and again.top_k is None
    assert again.seeds.tolist() == next_seeds.tolist() != seeds.tolist()
    # Other requests, another order, a grammar step: built anew.
    assert reuse.get([states[1], states[0]], next_seeds, None) is None
    assert reuse.get(states[:1], next_seeds[:1], None) is None
    assert reuse.get(states, next_seeds, GrammarBitmask(req_ids=["r0"], bitmask=b"\0" * 16)) \
        is None


@pytest.mark.parametrize("params", [{"min_tokens": 2}, {"presence_penalty": 0.5}])
def test_metadata_that_depends_on_the_tokens_is_not_kept(params) -> None:
    staging = SamplingStaging(8, torch.device("cpu"))
    reuse = SamplingMetadataReuse(staging)
    states = [make_state(0), make_state(1, **params)]
    seeds = build_row_seeds(states, 0, 0)
    reuse.keep(states, build_sampling_metadata(states, staging, 100, seeds))
    assert reuse.get(states, seeds, None) is None
