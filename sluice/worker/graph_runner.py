"""The runner's CUDA graphs: which sets are captured, and which graph (set, size) a step replays.

Lifecycle: once the KV cache is bound, `warm_up` runs eager steps on padding inputs so that their
Triton and cuBLAS kernels load now rather than in the first requests' steps; then, unless the
engine is eager, `capture` records four sets (sluice.worker.cuda_graphs.DecodeGraphs), all on the
InputBuilder's persistent device buffers and sharing one memory pool (one graph runs at a time),
in this order:

- decode batches, by number of requests (padded to the next captured size); and, where the
  attention backend would run other kernels for contexts shorter than SHORT_CONTEXT_TOKENS than
  for max_model_len (split-KV for long contexts, one program per request and KV head for short
  ones), those sizes again for short contexts: a step replays them while its longest context
  is that short;
- one prompt (maybe over a cached prefix), by padded token count;
- any other step (several prompts, prompts beside decodes), by padded token count, its requests
  padded to a fixed number;
- verification steps of speculative decoding, every request 1 + k tokens, by number of requests.
  Last, so that an engine with speculation captures the other three exactly as one without
  (same order, same pool state): with drafting off, the two replay the same graphs.

Per step the InputBuilder asks `verify_size` (which fixes the step's token layout) and then
`pad_for_graph`, which picks the graph and writes the padding rows and tokens that graph was
captured with: a padding request has no context (or, in a verification graph, q tokens over
none) and reads the null block; a padding token stores nothing (slot -1). Without graphs (CPU,
enforce_eager) every step runs eagerly. The sets are dropped at shutdown (`clear`). With a KV
connector, every graph is captured with its per-layer events (sluice/worker/layer_events.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from sluice.attention import AttentionMetadata
from sluice.attention.metadata import LayerKVHooks
from sluice.config import SchedulerConfig
from sluice.model.attention import attention_layers
from sluice.sample.sampler import Sampler
from sluice.worker.cuda_graphs import DecodeGraphs, capture_sizes
from sluice.worker.input_batch import CachedRequestState
from sluice.worker.step_inputs import InputBuilder

logger = logging.getLogger("sluice")

_MAX_GRAPH_BATCH = 512
# Decode steps whose contexts are all shorter than this replay the short-context decode graphs
# (where the attention backend's plan for them differs). From 2 requests (Qwen3-0.6B on an
# H200) the Triton backend splits no context under 2 x MIN_KEYS_PER_SPLIT = 512 keys, where a
# graph captured for max_model_len would run the splits of the longest context; and from 16
# requests it takes narrower tiles there (SHORT_DECODE_CONTEXT, the same 512). One request splits
# a short context into 8 slices of 64 keys (FEW_PROGRAMS_SM_FRACTION), fewer splits than a long
# one gets (benchmarks/journal/2026-11-25-short-context-decode-graphs.md).
SHORT_CONTEXT_TOKENS = 512
# One prompt's token buckets: powers of two up to 512, then 768, then from 1,024 steps of a
# quarter of the power of two below, so a prompt of more than 1,024 tokens pads by at most a
# fifth of its bucket (the paged and the dense graph of each size). With powers of two alone a
# 3,000-token Qwen3-8B prompt ran as 4,096: its GEMMs computed 37% padding rows
# (benchmarks/journal/2026-12-02-8b-prefill-and-decode.md).
_PREFILL_GRAPH_TOKENS = (64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584,
                         4096, 5120, 6144, 7168, 8192)
_MAX_PREFILL_GRAPH_TOKENS = _PREFILL_GRAPH_TOKENS[-1]

# A lone fresh prompt replays the dense-prefill graph of its padded size when it fills at
# least this share of it, or the graph is this small: dense attention computes every padding
# row, the paged kernel skips them. The break-even is near 0.55-0.77 of the padded size from
# 1,024 tokens up, under 0.5 at 512 and fewer (benchmarks/journal/2026-11-27-dense-prefill.md;
# benchmarks/tools/dense_fill_sweep.py measures it).
DENSE_MIN_FILL = 0.8
DENSE_ALWAYS_UP_TO = 512
# A lone prompt chunk over a cached prefix may run dense attention, eagerly, from this many
# tokens (an estimate): gathering the prefix's K/V out of the paged cache is then small next to
# the attention. Token budgets below it never do.
DENSE_OVER_PREFIX_MIN_TOKENS = 2048
# cuDNN builds an execution plan for each new shape of its attention, as long as the step itself
# (benchmarks/journal/2026-11-27-no-midrun-planning.md). So dense attention runs only
# on shapes planned before the first request: the dense-prefill graphs' sizes (fresh prompts
# run dense only there), and over a cached prefix only a chunk of the whole token budget over
# whole budgets (a long prompt's middle chunks), whose plans warm_up builds. The gathered and
# head-repeated prefix K/V of such a step stay under this many bytes (the activation reserve
# of sluice.worker.kv_cache holds them).
DENSE_PREFIX_MAX_BYTES = 1 << 30

# (input_ids [T], positions [T], metadata) of one captured size
GraphInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]


class GraphRunner:
    def __init__(self, inputs: InputBuilder, scheduler_config: SchedulerConfig,
                 query_len: int | None) -> None:
        """query_len: tokens per request of a verification step (1 + k), None without
        speculative decoding."""
        self.inputs = inputs
        self.scheduler_config = scheduler_config
        self.query_len = query_len
        self.graphs: DecodeGraphs | None = None  # decode batches, by number of requests
        # Decode batches whose contexts are all under SHORT_CONTEXT_TOKENS, by number of
        # requests: the sizes whose attention plan differs from the main set's.
        self.short_graphs: DecodeGraphs | None = None
        # (hidden, metadata) -> None, captured after the model's forward in every graph (an
        # EAGLE proposer's hidden-state store: sluice/worker/spec_decode.py); None: nothing.
        self.after_forward: Callable[[torch.Tensor, AttentionMetadata], None] | None = None
        self.prefill_graphs: DecodeGraphs | None = None  # one prompt, by number of tokens
        # One prompt over no cached context, its attention dense (AttentionMetadata.
        # dense_prefill), by number of tokens: captured where the backend supports it.
        self.dense_prefill_graphs: DecodeGraphs | None = None
        # Any other step (several prompts, prompts beside decodes), by number of tokens, its
        # requests padded to mixed_graph_reqs.
        self.mixed_graphs: DecodeGraphs | None = None
        self.mixed_graph_reqs = 0
        self.verify_graphs: DecodeGraphs | None = None  # decodes with 1 + k tokens each
        # Contexts over which a chunk of max_num_batched_tokens runs dense attention: those
        # warm_up planned (see DENSE_PREFIX_MAX_BYTES).
        self.dense_prefix_contexts: frozenset[int] = frozenset()
        self._layer_hooks: LayerKVHooks | None = None

    def clear(self) -> None:
        """Drop every graph and its memory pool (see ModelRunner.shutdown)."""
        self.graphs = self.prefill_graphs = self.mixed_graphs = self.verify_graphs = None
        self.short_graphs = self.dense_prefill_graphs = None

    # ---- per step ------------------------------------------------------------------------

    def verify_size(self, states: list[CachedRequestState], num_computed: np.ndarray,
                    num_scheduled: np.ndarray, num_drafts: np.ndarray,
                    device_rows: np.ndarray | None = None) -> int | None:
        """The verification graph to replay: every request a decode with drafts to verify
        (each padded to 1 + k tokens, still within max_model_len), and a size captured.
        device_rows: rows fixed on the device (device n-gram drafts), decodes by construction;
        num_computed counts their drafts in flight as accepted."""
        if self.verify_graphs is None or not num_drafts.any():
            return None
        q = self.query_len
        known = np.fromiter((len(s.token_ids) for s in states), np.int64, len(states))
        is_decode = num_computed + 1 == known
        if device_rows is not None:
            is_decode |= device_rows
        if ((~is_decode).any() or (num_scheduled != 1 + num_drafts).any()
                or (num_computed + q > self.scheduler_config.max_model_len).any()):
            return None
        return self.verify_graphs.padded_size(len(states))

    def dense_over_prefix_pays(self, num_tokens: int, context_len: int) -> bool:
        """Whether a lone prompt chunk of `num_tokens` over `context_len` cached tokens runs
        dense attention (eagerly) rather than the paged prompt graph: a shape warm_up planned
        (see DENSE_PREFIX_MAX_BYTES)."""
        return (num_tokens == self.scheduler_config.max_num_batched_tokens
                and context_len in self.dense_prefix_contexts)

    def pad_for_graph(self, num_reqs: int, num_tokens: int, num_layout_tokens: int,
                      verify_size: int | None, has_pending: bool, max_seq_len: int,
                      fresh: bool = False,
                      eager: bool = False) -> tuple[tuple[DecodeGraphs, int] | None, int]:
        """The graph that runs a step of `num_reqs` requests and `num_tokens` tokens
        (`num_layout_tokens` as laid out in the buffers) and the step's padded token count;
        the padding requests and tokens written to the host buffers. has_pending: an input token
        of the step is still in flight (a lone such request replays no prefill graph).
        max_seq_len: the step's longest context (a decode step's picks its graph set). fresh:
        the step is one prompt over no cached context (it may replay a dense-prefill graph).
        eager: the step runs without a graph (a dense prompt chunk over a cached prefix)."""
        buffers = self.inputs
        graph = None
        padded_reqs, padded_tokens = num_reqs, num_layout_tokens
        if eager:
            return graph, padded_tokens
        if verify_size is not None:
            q = self.query_len
            graph = (self.verify_graphs, verify_size)
            padded_reqs, padded_tokens = verify_size, verify_size * q
            # Padding requests: q tokens of nothing over no stored context.
            buffers.buf_seq_lens.np[num_reqs:verify_size] = q
            buffers.buf_query_start_loc.np[num_reqs + 1:verify_size + 1] = q * np.arange(
                num_reqs + 1, verify_size + 1)
        elif self.graphs is not None and num_tokens == num_reqs:
            decode = self.graphs
            size = decode.padded_size(num_reqs)
            if (size is not None and self.short_graphs is not None
                    and max_seq_len < SHORT_CONTEXT_TOKENS
                    and self.short_graphs.padded_size(num_reqs) == size):
                decode = self.short_graphs
            if size is not None:
                graph = (decode, size)
                padded_reqs = padded_tokens = size
                # Padding rows: no token to store, no context, the null block; ordered last.
                buffers.buf_seq_lens.np[num_reqs:size] = 0
                buffers.buf_query_start_loc.np[num_reqs + 1:size + 1] = np.arange(
                    num_reqs + 1, size + 1)
                buffers.buf_decode_order.np[num_reqs:size] = np.arange(num_reqs, size)
        elif self.prefill_graphs is not None and num_reqs == 1 and not has_pending:
            size = self.prefill_graphs.padded_size(num_tokens)
            if size is not None:
                prompts = self.prefill_graphs
                if fresh and self.dense_prefill_graphs is not None and dense_pays(num_tokens,
                                                                                   size):
                    prompts = self.dense_prefill_graphs
                graph = (prompts, size)
                padded_tokens = size  # tokens past query_start_loc[1] are padding
        if (graph is None and verify_size is None and self.mixed_graphs is not None
                and num_tokens > num_reqs and num_reqs <= self.mixed_graph_reqs):
            size = self.mixed_graphs.padded_size(num_tokens)
            if size is not None:
                graph = (self.mixed_graphs, size)
                padded_reqs, padded_tokens = self.mixed_graph_reqs, size
                # Padding requests: no queries (they start where the real tokens end), no
                # context; the tokens after the real ones belong to none and come out as zeros.
                buffers.buf_seq_lens.np[num_reqs:padded_reqs] = 0
                buffers.buf_query_start_loc.np[num_reqs + 1:padded_reqs + 1] = num_tokens
        if graph is not None:
            buffers.buf_input_ids.np[num_layout_tokens:padded_tokens] = 0
            buffers.buf_positions.np[num_layout_tokens:padded_tokens] = 0
            buffers.buf_slot_mapping.np[num_layout_tokens:padded_tokens] = -1
        return graph, padded_tokens

    # ---- before the first request ----------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, model: nn.Module, sampler: Sampler) -> None:
        """Compile the kernels of eager steps now rather than in the first requests' (a Triton
        variant compiled mid-run stalls its step by up to a second): a step of two prompts, and
        a mixed step of two decodes and a prompt, on padding inputs (nothing stored, the null
        block read); then the sampler's variants."""
        # A full token budget: GEMM kernels of that size load, and the allocator grows, now.
        prompt = min(self.scheduler_config.max_num_batched_tokens // 2,
                     self.scheduler_config.max_model_len)
        hidden = self._warm_up_step(model, [prompt, prompt], [prompt, prompt])
        if self.scheduler_config.max_num_seqs >= 3 and prompt > 2:
            self._warm_up_step(model, [2, 2, prompt - 2], [1, 1, prompt - 2])
        sampler.warm_up(model.compute_logits(hidden[:2], upcast=False))
        # The LM head runs eagerly on the rows that sample (1 to max_num_seqs), and cuBLAS picks
        # its kernel by row count. CUDA loads a kernel lazily on its first launch, and that load
        # waits for the device to go idle: mid-run the host stalled in the LM head for a whole
        # step, and the device then idled while the next step was prepared
        # (benchmarks/journal/2026-11-22-lm-head-lazy-loading.md). Launch every row count once.
        rows = self.scheduler_config.max_num_seqs
        states = hidden[:rows] if hidden.shape[0] >= rows else hidden.new_zeros(
            rows, hidden.shape[1])
        for num_rows in range(1, rows + 1):
            model.compute_logits(states[:num_rows], upcast=False)
        if self.inputs.dense_prefix:
            self._plan_dense_prefix(model)
        torch.cuda.synchronize()

    def _plan_dense_prefix(self, model: nn.Module) -> None:
        """Run the eager step of a token budget's chunk over each prefix of whole budgets that
        may take dense attention (DENSE_PREFIX_MAX_BYTES), so cuDNN plans its shapes now."""
        chunk = self.scheduler_config.max_num_batched_tokens
        layers = list(attention_layers(model).values())
        if chunk < DENSE_OVER_PREFIX_MIN_TOKENS or not layers:
            return
        layer = layers[0]
        element_size = layer.kv_cache.element_size()
        # Gathered (K/V heads) and repeated (query heads) keys and values, per context token.
        context_bytes = 2 * (layer.num_kv_heads + layer.num_heads) * layer.head_dim * element_size
        contexts = []
        context = chunk
        while (context + chunk <= self.scheduler_config.max_model_len
               and context * context_bytes <= DENSE_PREFIX_MAX_BYTES):
            self._warm_up_step(model, [context + chunk], [chunk], dense=True)
            contexts.append(context)
            context += chunk
        self.dense_prefix_contexts = frozenset(contexts)

    def _warm_up_step(self, model: nn.Module, seq_lens: list[int],
                      query_lens: list[int], dense: bool = False) -> torch.Tensor:
        b = self.inputs
        num_reqs, num_tokens = len(seq_lens), sum(query_lens)
        b.buf_input_ids.np[:num_tokens] = 0
        b.buf_positions.np[:num_tokens] = np.concatenate(
            [np.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
        b.buf_slot_mapping.np[:num_tokens] = -1
        b.buf_query_start_loc.np[0] = 0
        b.buf_query_start_loc.np[1:num_reqs + 1] = np.cumsum(query_lens)
        b.buf_seq_lens.np[:num_reqs] = seq_lens
        width = -(-max(seq_lens) // b.block_size)
        b.buf_block_tables.np[:b.num_groups * num_reqs * width] = 0
        for buf, n in ((b.buf_input_ids, num_tokens), (b.buf_positions, num_tokens),
                       (b.buf_slot_mapping, num_tokens),
                       (b.buf_query_start_loc, num_reqs + 1), (b.buf_seq_lens, num_reqs)):
            buf.to_device(n)
        if b.num_groups > 1:
            b.buf_group_slot_mapping.np[:(b.num_groups - 1) * num_tokens] = -1
            b.buf_group_slot_mapping.to_device((b.num_groups - 1) * num_tokens)
        block_tables = b.buf_block_tables.to_device(b.num_groups * num_reqs * width)[
            :num_reqs * width].view(num_reqs, width)
        metadata = b.metadata(num_reqs, num_tokens, max_query_len=max(query_lens),
                              max_seq_len=max(seq_lens), block_tables=block_tables,
                              group_tables=b.compact_group_tables(num_reqs, width, num_tokens))
        metadata.dense_prefill = dense
        return model(b.buf_input_ids.device[:num_tokens], b.buf_positions.device[:num_tokens],
                     metadata)

    @torch.inference_mode()
    def capture(self, model: nn.Module, layer_hooks: LayerKVHooks | None = None) -> None:
        """`layer_hooks`: captured into every graph (a KV connector's per-layer events, see
        sluice/worker/layer_events.py); None without a connector."""
        b = self.inputs
        self._layer_hooks = layer_hooks
        forward = self._forward(model)
        max_model_len = self.scheduler_config.max_model_len
        max_size = min(self.scheduler_config.max_num_seqs, _MAX_GRAPH_BATCH)
        self.graphs = DecodeGraphs(capture_sizes(max_size))
        # Capture on all-padding inputs: no KV is stored, nothing is read.
        b.buf_input_ids.np[:] = 0
        b.buf_positions.np[:] = 0
        b.buf_slot_mapping.np[:] = -1
        b.buf_seq_lens.np[:] = 0
        b.buf_query_start_loc.np[:] = np.arange(b.buf_query_start_loc.np.shape[0])
        b.buf_decode_order.np[:] = np.arange(b.buf_decode_order.np.shape[0])
        buffers = [b.buf_input_ids, b.buf_positions, b.buf_slot_mapping,
                   b.buf_seq_lens, b.buf_query_start_loc, b.buf_decode_order]
        if b.buf_group_slot_mapping is not None:  # a hybrid model's other KV cache groups
            b.buf_group_slot_mapping.np[:] = -1
            buffers.append(b.buf_group_slot_mapping)
        for buf in buffers:
            buf.to_device(buf.np.shape[0])

        def decode_inputs(max_seq_len: int) -> Callable[[int], GraphInputs]:
            def make_inputs(size: int) -> GraphInputs:
                metadata = b.metadata(size, size, max_query_len=1, max_seq_len=max_seq_len,
                                      block_tables=b.graph_block_tables[:size],
                                      decode_order=b.buf_decode_order.device[:size],
                                      group_tables=b.graph_group_tables(size, size))
                return b.buf_input_ids.device[:size], b.buf_positions.device[:size], metadata
            return make_inputs

        self.graphs.capture(forward, self._hooked(decode_inputs(max_model_len)))
        logger.info("captured CUDA graphs for decode batch sizes %s", self.graphs.sizes)
        short = SHORT_CONTEXT_TOKENS - 1
        plan = _decode_plan(model)
        if plan is not None and max_model_len > short:
            sizes = [s for s in self.graphs.sizes if plan(s, short) != plan(s, max_model_len)]
            if sizes:
                self.short_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)
                self.short_graphs.capture(forward, self._hooked(decode_inputs(short)))
                logger.info("captured CUDA graphs for decode batch sizes %s with contexts "
                            "under %d tokens", sizes, SHORT_CONTEXT_TOKENS)
        self._capture_prompt_graphs(model, max_size)
        if self.query_len is not None:
            self._capture_verify_graphs(model, max_size)

    def _capture_prompt_graphs(self, model: nn.Module, max_size: int) -> None:
        """Steps with prompts: one prompt, and any other step of several requests."""
        forward = self._forward(model)
        b = self.inputs
        max_model_len = self.scheduler_config.max_model_len
        # One prompt (maybe over a cached prefix) padded to a token bucket: the prefill of a
        # lone request is otherwise dominated by launching ~30 kernels a layer from Python.
        max_tokens = min(self.scheduler_config.max_num_batched_tokens, max_model_len,
                         _MAX_PREFILL_GRAPH_TOKENS)
        sizes = prefill_graph_sizes(max_tokens)
        if not sizes:
            return
        self.prefill_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)

        def prefill_inputs(dense: bool) -> Callable[[int], GraphInputs]:
            def make_inputs(size: int) -> GraphInputs:
                b.buf_query_start_loc.np[:2] = [0, size]
                b.buf_seq_lens.np[:1] = size
                b.buf_query_start_loc.to_device(2)
                b.buf_seq_lens.to_device(1)
                metadata = b.metadata(1, size, max_query_len=size, max_seq_len=max_model_len,
                                      block_tables=b.graph_block_tables[:1],
                                      group_tables=b.graph_group_tables(1, size))
                metadata.dense_prefill = dense
                return b.buf_input_ids.device[:size], b.buf_positions.device[:size], metadata
            return make_inputs

        self.prefill_graphs.capture(forward, self._hooked(prefill_inputs(dense=False)))
        logger.info("captured CUDA graphs for one-prompt prefills of %s tokens", sizes)
        if b.dense_prefill:
            self.dense_prefill_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)
            self.dense_prefill_graphs.capture(forward, self._hooked(prefill_inputs(dense=True)))
            logger.info("captured CUDA graphs for one fresh prompt of %s tokens, dense "
                        "attention", sizes)

        # Every other step: several prompts, or prompts beside decodes (what a full token budget
        # of an offline run or a server under load schedules). Its requests are padded to
        # max_size: padding requests have no queries and no context. Eagerly such a step was
        # bound by launching ~50 kernels a layer from Python.
        self.mixed_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)
        self.mixed_graph_reqs = max_size

        def make_mixed_inputs(size: int) -> GraphInputs:
            b.buf_query_start_loc.np[:max_size + 1] = 0  # every token is padding
            b.buf_seq_lens.np[:max_size] = 0
            b.buf_query_start_loc.to_device(max_size + 1)
            b.buf_seq_lens.to_device(max_size)
            # max_query_len > a decode tile's queries: the attention runs its decode rows and its
            # prompt rows in two launches, as an eager mixed step does.
            metadata = b.metadata(max_size, size, max_query_len=size, max_seq_len=max_model_len,
                                  block_tables=b.graph_block_tables[:max_size],
                                  group_tables=b.graph_group_tables(max_size, size))
            return b.buf_input_ids.device[:size], b.buf_positions.device[:size], metadata

        self.mixed_graphs.capture(forward, self._hooked(make_mixed_inputs))
        logger.info("captured CUDA graphs for steps of several requests, %s tokens", sizes)

    def _forward(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        """The forward to capture: the model's, then `after_forward` (if any) on its hidden
        states and metadata."""
        after = self.after_forward
        if after is None:
            return model

        def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                    metadata: AttentionMetadata) -> torch.Tensor:
            hidden = model(input_ids, positions, metadata)
            after(hidden, metadata)
            return hidden

        return forward

    def _hooked(self, make_inputs: Callable[[int], GraphInputs]) -> Callable[[int], GraphInputs]:
        """make_inputs whose metadata carries the layer hooks to capture (if any)."""
        hooks = self._layer_hooks
        if hooks is None:
            return make_inputs

        def hooked(size: int) -> GraphInputs:
            input_ids, positions, metadata = make_inputs(size)
            metadata.kv_hooks = hooks
            return input_ids, positions, metadata

        return hooked

    def _capture_verify_graphs(self, model: nn.Module, max_size: int) -> None:
        """Verification steps of decodes with drafts: every request laid out as 1 + k tokens
        (fewer drafts are padded: no KV stored, outputs ignored)."""
        forward = self._forward(model)
        b = self.inputs
        q = self.query_len
        max_tokens = b.buf_input_ids.np.shape[0]
        sizes = [s for s in capture_sizes(max_size) if s * q <= max_tokens]
        if not sizes:
            return
        self.verify_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)

        def make_inputs(size: int) -> GraphInputs:
            b.buf_query_start_loc.np[:size + 1] = np.arange(size + 1) * q
            b.buf_seq_lens.np[:size] = q
            b.buf_query_start_loc.to_device(size + 1)
            b.buf_seq_lens.to_device(size)
            metadata = b.metadata(size, size * q, max_query_len=q,
                                  max_seq_len=self.scheduler_config.max_model_len,
                                  block_tables=b.graph_block_tables[:size],
                                  group_tables=b.graph_group_tables(size, size * q))
            metadata.split_queries = True
            return b.buf_input_ids.device[:size * q], b.buf_positions.device[:size * q], metadata

        self.verify_graphs.capture(forward, self._hooked(make_inputs))
        logger.info("captured CUDA graphs for verification of %d tokens per request, batch "
                    "sizes %s", q, sizes)


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The one-prompt graph sizes for prompts of up to `max_tokens` (the smaller of the token
    budget, max_model_len and the largest bucket): the buckets up to it, and `max_tokens`
    itself where no bucket ends there, so every prompt the engine admits has a graph. With
    max_model_len 3,064 a 3,000-token prompt otherwise ran eagerly (the 3,072 bucket is over
    it): 73.9 ms of device time against 50.8 ms graphed on an H200 with FP8 weights, whose
    launches from Python outlast their kernels
    (benchmarks/results/latency/2026-12-02-prefill-trace-8b-h200.json)."""
    sizes = [t for t in _PREFILL_GRAPH_TOKENS if t <= max_tokens]
    if max_tokens < _MAX_PREFILL_GRAPH_TOKENS and (not sizes or sizes[-1] < max_tokens):
        sizes.append(max_tokens)
    return sizes


def dense_pays(num_tokens: int, padded_tokens: int) -> bool:
    """Whether a fresh prompt of `num_tokens` runs faster in the dense-prefill graph of
    `padded_tokens` than in the paged one (see DENSE_MIN_FILL)."""
    return padded_tokens <= DENSE_ALWAYS_UP_TO or num_tokens >= DENSE_MIN_FILL * padded_tokens


def _decode_plan(model: nn.Module) -> Callable[[int, int], object] | None:
    """(num_reqs, max_seq_len) -> what the model's attention backend runs for such a decode
    batch (its optional `decode_plan`), or None where the backend does not say."""
    layers = attention_layers(model)
    if not layers:
        return None
    layer = next(iter(layers.values()))
    decode_plan = getattr(layer.backend, "decode_plan", None)
    if decode_plan is None:
        return None
    device, cache_dtype = layer.kv_cache.device, layer.kv_cache.dtype
    return lambda num_reqs, max_seq_len: decode_plan(num_reqs, layer.num_kv_heads, max_seq_len,
                                                     device, cache_dtype)
