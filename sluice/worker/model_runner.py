"""SchedulerOutput in, one forward pass, ModelRunnerOutput out.

The runner keeps each request's state (token ids, block-table row, sampling generator) from the
step it first appears until it shows up in `finished_req_ids`; preempted requests keep their
state (so a seeded generator continues where it stopped) and get a fresh block table on resume.
It never decides policy: which tokens to compute comes entirely from the scheduler.

Per step: host inputs are built with numpy into pinned buffers and copied to fixed device buffers
without blocking; a step replays a CUDA graph when one fits it (a batch of decodes by its padded
size, a lone prompt or any other step by its padded token count); only the rows that reach the
end of their known tokens are sampled.

With speculative decoding (see sluice/worker/spec_decode.py) a request's drafts ride at the end
of its scheduled tokens; the step then runs synchronously: verify, append, propose.
"""

from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from sluice.attention import AttentionMetadata, get_attention_backend
from sluice.attention.kv_layout import allocate_kv_caches
from sluice.config import CacheConfig, ModelConfig, SchedulerConfig
from sluice.core.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorOutput,
    ModelRunnerOutput,
    PositionLogprobs,
    SchedulerOutput,
)
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import HFModelConfig
from sluice.model.loader import load_model, resolve_dtype
from sluice.sample.sampler import Sampler, compute_topk_logprobs
from sluice.sampling_params import SamplingParams
from sluice.worker.cuda_graphs import DecodeGraphs, capture_sizes
from sluice.worker.input_batch import (
    BlockTables,
    CachedRequestState,
    StagedArena,
    StagedBuffer,
)
from sluice.worker.kv_cache import determine_num_blocks
from sluice.worker.kv_connector import KVConnectorWorker
from sluice.worker.sampling_inputs import (
    SamplingStaging,
    build_row_seeds,
    build_sampling_metadata,
)
from sluice.worker.spec_decode import SpecDecoder, can_speculate
from sluice.worker.step_handle import StepHandle, position_logprobs

logger = logging.getLogger("sluice")

_MAX_GRAPH_BATCH = 512
_PREFILL_GRAPH_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
_MAX_PREFILL_GRAPH_TOKENS = _PREFILL_GRAPH_TOKENS[-1]


@dataclass(slots=True)
class StepInputs:
    req_ids: list[str]
    states: list[CachedRequestState]
    num_tokens: int
    num_computed: np.ndarray  # [B] before this step
    num_scheduled: np.ndarray  # [B]
    # [B + 1] where each request's tokens start in the step's flattened tokens (a verification
    # CUDA graph lays requests out every 1 + k tokens, padding after the real ones)
    query_start_loc: np.ndarray
    num_drafts: np.ndarray  # [B] draft tokens at the end of each request's scheduled tokens
    drafts: list[list[int]]
    block_tables: torch.Tensor  # [B, most blocks of any request], on the device
    graph: tuple[DecodeGraphs, int] | None  # the CUDA graph to replay (graph set, size), if any
    ordered: bool  # a decode batch: buf_decode_order holds its longest-first order


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device(device)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, hf_config: HFModelConfig) -> None:
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.hf_config = hf_config
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, hf_config)
        self.block_size = cache_config.block_size
        backend_name = model_config.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "torch_ref"
        self.attn_backend = get_attention_backend(backend_name)
        torch.manual_seed(model_config.seed)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(model_config.seed)
        self.sampler = Sampler(default_generator=generator)
        # This engine's GPU share: gpu_memory_utilization of the device, but never more than was
        # free when it started (another engine in the process may hold the rest), less weights.
        gpu_share = 0
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            gpu_share = min(free, int(total * cache_config.gpu_memory_utilization))
            allocated_before = torch.cuda.memory_allocated(self.device)
        self.model = load_model(model_config.model, hf_config, self.dtype, self.device,
                                self.attn_backend)
        self.spec: SpecDecoder | None = None
        if scheduler_config.speculative_config is not None:
            self.spec = SpecDecoder(self, scheduler_config.speculative_config)
        if self.device.type == "cuda":
            gpu_share -= torch.cuda.memory_allocated(self.device) - allocated_before
            if not model_config.enforce_eager:
                from sluice.worker.compile import install_fused_ops

                install_fused_ops(self.model)
        self.gpu_bytes_available = gpu_share

        self.requests: dict[str, CachedRequestState] = {}
        max_num_reqs = scheduler_config.max_num_seqs
        self.max_blocks_per_req = -(-scheduler_config.max_model_len // self.block_size)
        self.block_tables = BlockTables(self.max_blocks_per_req, initial_rows=max_num_reqs)
        max_tokens = max(scheduler_config.max_num_batched_tokens, max_num_reqs)
        dev = self.device
        # One step's inputs, in the order they travel: the per-request arrays and the block
        # tables (compact, [B, width] of this step) in one copy, the per-token arrays in
        # another (see _upload_inputs). CUDA graphs read the block tables from a fixed
        # full-width table, filled on the device.
        arena = StagedArena({
            "query_start_loc": ((max_num_reqs + 1,), torch.int32),
            "seq_lens": ((max_num_reqs,), torch.int32),
            # A decode batch's requests, longest context first (AttentionMetadata.decode_order).
            "decode_order": ((max_num_reqs,), torch.int32),
            # Where tokens still in flight go in this step's input ids: (destination, source).
            "pending": ((2 * max_num_reqs,), torch.int64),
            "block_tables": ((max_num_reqs * self.max_blocks_per_req,), torch.int32),
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
        }, dev)
        self.inputs_arena = arena
        self.buf_query_start_loc = arena.buffers["query_start_loc"]
        self.buf_seq_lens = arena.buffers["seq_lens"]
        self.buf_decode_order = arena.buffers["decode_order"]
        self.buf_pending = arena.buffers["pending"]
        self.buf_block_tables = arena.buffers["block_tables"]
        self.buf_input_ids = arena.buffers["input_ids"]
        self.buf_positions = arena.buffers["positions"]
        self.buf_slot_mapping = arena.buffers["slot_mapping"]
        self.graph_block_tables = (
            torch.zeros((max_num_reqs, self.max_blocks_per_req), dtype=torch.int32, device=dev)
            if dev.type == "cuda" else None)
        # Two of each per-launch staging buffer, alternating by sampling launch: the rows to
        # sample are uploaded, and the sampled ids read back, asynchronously, so the host may
        # write the next launch's while the device has not reached this one's copy yet (with
        # async scheduling it launches step N + 1 before waiting for step N; it waits for N
        # before launching N + 2, so two suffice). One logits-index buffer was overwritten so
        # under a server's load: mixed steps replaying CUDA graphs outran the device, and a
        # step gathered its hidden rows with the next step's indices (out of bounds).
        self.buf_logits_indices = [StagedBuffer((max_tokens,), torch.int64, dev)
                                   for _ in range(2)]
        self._sampled_host = [torch.zeros(max_num_reqs, dtype=torch.int64,
                                          pin_memory=dev.type == "cuda") for _ in range(2)]
        self._launch_parity = 0
        self.sampling_staging = SamplingStaging(max_num_reqs, dev)
        self._num_sampling_launches = 0  # keys the fused sampler's unseeded rows
        self._last_step: StepHandle | None = None
        self._inputs_copied: torch.cuda.Event | None = None
        self.graphs: DecodeGraphs | None = None  # decode batches, by number of requests
        self.prefill_graphs: DecodeGraphs | None = None  # one prompt, by number of tokens
        # Any other step (several prompts, prompts beside decodes), by number of tokens, its
        # requests padded to mixed_graph_reqs.
        self.mixed_graphs: DecodeGraphs | None = None
        self.mixed_graph_reqs = 0
        self.verify_graphs: DecodeGraphs | None = None  # decodes with 1 + k tokens each
        # {layer_name: [2, num_blocks, block_size, KVH, D]} in layer order (kv_layout)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.num_blocks = 0
        # This rank's half of the KV connector, if one is configured (set by the Worker).
        self.kv_connector: KVConnectorWorker | None = None

    def shutdown(self) -> None:
        """Drop every device tensor this runner holds (see EngineCore.shutdown)."""
        self.graphs = self.prefill_graphs = self.mixed_graphs = self.verify_graphs = None
        self._last_step = None
        self.spec = None
        self.requests.clear()
        self.kv_caches = {}
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()
            torch.cuda.empty_cache()

    # ---- KV cache and CUDA graphs --------------------------------------------------------

    def determine_num_blocks(self) -> int:
        extra = self.spec.kv_bytes_per_block() if self.spec is not None else 0
        return determine_num_blocks(self.cache_config, self.scheduler_config, self.hf_config,
                                    self.dtype, self.device, self.gpu_bytes_available,
                                    extra_bytes_per_block=extra)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        hf = self.hf_config
        self.kv_caches = allocate_kv_caches(list(attention_layers(self.model)), num_blocks,
                                            self.block_size, hf.num_key_value_heads,
                                            hf.head_dim, self.dtype, self.device)
        bind_kv_caches(self.model, self.kv_caches)
        self.num_blocks = num_blocks
        if self.spec is not None:
            self.spec.initialize_kv_cache(num_blocks)
        if self.device.type == "cuda":
            self._warm_up_prefill()
        if (self.device.type == "cuda" and not self.model_config.enforce_eager
                and getattr(self.attn_backend, "supports_cuda_graphs", False)):
            self._capture_graphs()

    @torch.inference_mode()
    def _warm_up_prefill(self) -> None:
        """Compile the kernels of eager steps now rather than in the first requests' (a Triton
        variant compiled mid-run stalls its step by up to a second): a step of two prompts, and
        a mixed step of two decodes and a prompt, on padding inputs (nothing stored, the null
        block read); then the sampler's variants."""
        # A full token budget: GEMM kernels of that size load, and the allocator grows, now.
        prompt = min(self.scheduler_config.max_num_batched_tokens // 2,
                     self.scheduler_config.max_model_len)
        hidden = self._warm_up_step([prompt, prompt], [prompt, prompt])
        if self.scheduler_config.max_num_seqs >= 3 and prompt > 2:
            self._warm_up_step([2, 2, prompt - 2], [1, 1, prompt - 2])
        self.sampler.warm_up(self.model.compute_logits(hidden[:2], upcast=False))
        # The LM head runs eagerly on the rows that sample (1 to max_num_seqs), and cuBLAS picks
        # its kernel by row count. CUDA loads a kernel lazily on its first launch, and that load
        # waits for the device to go idle: mid-run the host stalled in the LM head for a whole
        # step (H200: 18 to 23 ms in each of the first 18 prompt steps of the nano-vllm
        # workload, 5 to 11 ms at 15 decode batch sizes), and the device then idled while the
        # next step was prepared. Launch every row count once now.
        rows = self.scheduler_config.max_num_seqs
        states = hidden[:rows] if hidden.shape[0] >= rows else hidden.new_zeros(
            rows, hidden.shape[1])
        for num_rows in range(1, rows + 1):
            self.model.compute_logits(states[:num_rows], upcast=False)
        torch.cuda.synchronize()

    def _warm_up_step(self, seq_lens: list[int], query_lens: list[int]) -> torch.Tensor:
        num_reqs, num_tokens = len(seq_lens), sum(query_lens)
        self.buf_input_ids.np[:num_tokens] = 0
        self.buf_positions.np[:num_tokens] = np.concatenate(
            [np.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
        self.buf_slot_mapping.np[:num_tokens] = -1
        self.buf_query_start_loc.np[0] = 0
        self.buf_query_start_loc.np[1:num_reqs + 1] = np.cumsum(query_lens)
        self.buf_seq_lens.np[:num_reqs] = seq_lens
        width = -(-max(seq_lens) // self.block_size)
        self.buf_block_tables.np[:num_reqs * width] = 0
        for buf, n in ((self.buf_input_ids, num_tokens), (self.buf_positions, num_tokens),
                       (self.buf_slot_mapping, num_tokens),
                       (self.buf_query_start_loc, num_reqs + 1), (self.buf_seq_lens, num_reqs)):
            buf.to_device(n)
        block_tables = self.buf_block_tables.to_device(num_reqs * width).view(num_reqs, width)
        metadata = self._metadata(num_reqs, num_tokens, max_query_len=max(query_lens),
                                  max_seq_len=max(seq_lens), block_tables=block_tables)
        return self.model(self.buf_input_ids.device[:num_tokens],
                          self.buf_positions.device[:num_tokens], metadata)

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        max_size = min(self.scheduler_config.max_num_seqs, _MAX_GRAPH_BATCH)
        self.graphs = DecodeGraphs(capture_sizes(max_size))
        # Capture on all-padding inputs: no KV is stored, nothing is read.
        self.buf_input_ids.np[:] = 0
        self.buf_positions.np[:] = 0
        self.buf_slot_mapping.np[:] = -1
        self.buf_seq_lens.np[:] = 0
        self.buf_query_start_loc.np[:] = np.arange(self.buf_query_start_loc.np.shape[0])
        self.buf_decode_order.np[:] = np.arange(self.buf_decode_order.np.shape[0])
        for buf in (self.buf_input_ids, self.buf_positions, self.buf_slot_mapping,
                    self.buf_seq_lens, self.buf_query_start_loc, self.buf_decode_order):
            buf.to_device(buf.np.shape[0])

        def make_inputs(size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
            metadata = self._metadata(size, size, max_query_len=1,
                                      max_seq_len=self.scheduler_config.max_model_len,
                                      block_tables=self.graph_block_tables[:size],
                                      decode_order=self.buf_decode_order.device[:size])
            return (self.buf_input_ids.device[:size], self.buf_positions.device[:size],
                    metadata)

        self.graphs.capture(self.model, make_inputs)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.graphs.sizes)
        if self.spec is not None:
            self._capture_verify_graphs(max_size)

        # One prompt (maybe over a cached prefix) padded to a token bucket: the prefill of a
        # lone request is otherwise dominated by launching ~30 kernels a layer from Python.
        max_tokens = min(self.scheduler_config.max_num_batched_tokens,
                         self.scheduler_config.max_model_len, _MAX_PREFILL_GRAPH_TOKENS)
        sizes = [t for t in _PREFILL_GRAPH_TOKENS if t <= max_tokens]
        if not sizes:
            return
        self.prefill_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)

        def make_prefill_inputs(size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                     AttentionMetadata]:
            self.buf_query_start_loc.np[:2] = [0, size]
            self.buf_seq_lens.np[:1] = size
            self.buf_query_start_loc.to_device(2)
            self.buf_seq_lens.to_device(1)
            metadata = self._metadata(1, size, max_query_len=size,
                                      max_seq_len=self.scheduler_config.max_model_len,
                                      block_tables=self.graph_block_tables[:1])
            return (self.buf_input_ids.device[:size], self.buf_positions.device[:size],
                    metadata)

        self.prefill_graphs.capture(self.model, make_prefill_inputs)
        logger.info("captured CUDA graphs for one-prompt prefills of %s tokens", sizes)

        # Every other step: several prompts, or prompts beside decodes (what a full token budget
        # of an offline run or a server under load schedules). Its requests are padded to
        # max_size: padding requests have no queries and no context. Eagerly such a step was
        # bound by launching ~50 kernels a layer from Python.
        self.mixed_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)
        self.mixed_graph_reqs = max_size

        def make_mixed_inputs(size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                  AttentionMetadata]:
            self.buf_query_start_loc.np[:max_size + 1] = 0  # every token is padding
            self.buf_seq_lens.np[:max_size] = 0
            self.buf_query_start_loc.to_device(max_size + 1)
            self.buf_seq_lens.to_device(max_size)
            # max_query_len > a decode tile's queries: the attention runs its decode rows and its
            # prompt rows in two launches, as an eager mixed step does.
            metadata = self._metadata(max_size, size, max_query_len=size,
                                      max_seq_len=self.scheduler_config.max_model_len,
                                      block_tables=self.graph_block_tables[:max_size])
            return (self.buf_input_ids.device[:size], self.buf_positions.device[:size],
                    metadata)

        self.mixed_graphs.capture(self.model, make_mixed_inputs)
        logger.info("captured CUDA graphs for steps of several requests, %s tokens", sizes)

    def _capture_verify_graphs(self, max_size: int) -> None:
        """Verification steps of decodes with drafts: every request laid out as 1 + k tokens
        (fewer drafts are padded: no KV stored, outputs ignored)."""
        q = self.spec.query_len
        max_tokens = self.buf_input_ids.np.shape[0]
        sizes = [s for s in capture_sizes(max_size) if s * q <= max_tokens]
        if not sizes:
            return
        self.verify_graphs = DecodeGraphs(sizes, pool=self.graphs.pool)

        def make_inputs(size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
            self.buf_query_start_loc.np[:size + 1] = np.arange(size + 1) * q
            self.buf_seq_lens.np[:size] = q
            self.buf_query_start_loc.to_device(size + 1)
            self.buf_seq_lens.to_device(size)
            metadata = self._metadata(size, size * q, max_query_len=q,
                                      max_seq_len=self.scheduler_config.max_model_len,
                                      block_tables=self.graph_block_tables[:size])
            return (self.buf_input_ids.device[:size * q], self.buf_positions.device[:size * q],
                    metadata)

        self.verify_graphs.capture(self.model, make_inputs)
        logger.info("captured CUDA graphs for verification of %d tokens per request, batch "
                    "sizes %s", q, sizes)

    # ---- one step ------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Queue one step on the device without waiting for it; tokens of a step still in
        flight are read on the device."""
        self._update_states(scheduler_output)
        previous = self._last_step
        connector = self.kv_connector
        layerwise = False
        if connector is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            connector.start_load_kv()
            # Loads are waited for layer by layer: the hooks must run, so no CUDA graph.
            layerwise = connector.has_loads()
        if scheduler_output.is_empty:
            if connector is None:
                return StepHandle(EMPTY_MODEL_RUNNER_OUTPUT, previous)
            output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            self._end_connector_step(scheduler_output, output, None, saved=True)
            return StepHandle(output, previous)
        if previous is not None and any(
                s.pending_step is not None and _needs_token_history(s.sampling_params)
                for s in (self.requests[r] for r in scheduler_output.num_scheduled_tokens)):
            previous.result()  # penalties and min_tokens count tokens on the host
        step = self._prepare_inputs(scheduler_output, allow_graph=not layerwise)
        if step.graph is not None:
            graphs, size = step.graph
            hidden = graphs.replay(size)
        else:
            num_reqs = len(step.states)
            metadata = self._metadata(
                num_reqs, step.num_tokens, max_query_len=int(step.num_scheduled.max()),
                max_seq_len=int((step.num_computed + step.num_scheduled).max()),
                block_tables=step.block_tables,
                decode_order=self.buf_decode_order.device[:num_reqs] if step.ordered else None)
            if layerwise:
                metadata.kv_hooks = connector
            hidden = self.model(self.buf_input_ids.device[:step.num_tokens],
                                self.buf_positions.device[:step.num_tokens], metadata)

        states = step.states
        seq_lens = (step.num_computed + step.num_scheduled - step.num_drafts).tolist()
        output = ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=[[] for _ in states])
        handle = StepHandle(output, previous)
        self._last_step = handle
        # A request samples once its chunk reaches the end of its tokens (known or in flight).
        sample_rows = [i for i, s in enumerate(states)
                       if seq_lens[i] == len(s.token_ids) + (s.pending_step is not None)]
        if connector is not None:
            failed = self._end_connector_step(scheduler_output, output, step, saved=layerwise)
            if failed:
                # Their KV is partly garbage: nothing computed over it is handed out; the
                # scheduler recomputes from the first bad block (or fails the request). (Loads
                # never serve requests that want prompt logprobs: those skip every cache.)
                sample_rows = [i for i in sample_rows if i not in failed]
        self._compute_prompt_logprobs(step, hidden, output)
        if self.spec is not None:
            # Rows with drafts are verified by the rejection sampler, and so are the others
            # (as rows of no drafts: one read-back for the step) unless one needs what only
            # the sampler applies (penalties, min_tokens, logprobs).
            verify_rows = sample_rows
            if not all(can_speculate(states[i].sampling_params) for i in sample_rows):
                verify_rows = [i for i in sample_rows if step.num_drafts[i]]
                self._sample(step, hidden, [i for i in sample_rows if not step.num_drafts[i]],
                             handle)
                handle.result()
            self.spec.verify(step, hidden, verify_rows, output)
            self.spec.propose(step, hidden, output)
            return handle
        self._sample(step, hidden, sample_rows, handle)
        return handle

    def _end_connector_step(self, scheduler_output: SchedulerOutput,
                            output: ModelRunnerOutput, step: StepInputs | None,
                            saved: bool) -> set[int]:
        """The connector's end of a step: saves (every layer at once after a graph replay or
        an eager step without hooks), completions, load errors, into the step's output.
        Returns the rows of `step` whose blocks failed to load."""
        connector = self.kv_connector
        if not saved:
            for layer_name, kv_cache in self.kv_caches.items():
                connector.save_kv_layer(layer_name, kv_cache, None)
        connector.wait_for_save()
        # Completions before errors: a connector records a load's errors before its end.
        finished_sending, finished_recving = connector.get_finished(
            scheduler_output.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        output.kv_connector_output = KVConnectorOutput(
            finished_sending=set(finished_sending), finished_recving=set(finished_recving),
            invalid_block_ids=set(invalid), stats=connector.get_stats())
        connector.clear_connector_metadata()
        if not invalid or step is None:
            return set()
        table = self.block_tables.table
        num_blocks = self.block_tables.num_blocks
        return {i for i, state in enumerate(step.states)
                if invalid.intersection(table[state.row, :num_blocks[state.row]].tolist())}

    def _sample(self, step: StepInputs, hidden: torch.Tensor, sample_rows: list[int],
                handle: StepHandle) -> None:
        """Sample one token for each row of `sample_rows` (queued on the device)."""
        if not sample_rows:
            return
        states = step.states
        self._launch_parity ^= 1
        if step.num_tokens == len(states) and len(sample_rows) == len(states):
            sample_hidden = hidden[:len(states)]  # all decodes, all sampling
        else:
            indices = self.buf_logits_indices[self._launch_parity]
            last = step.query_start_loc[:-1] + step.num_scheduled - 1
            indices.np[:len(sample_rows)] = last[sample_rows]
            sample_hidden = hidden[indices.to_device(len(sample_rows))]
        # [S, V] in the model dtype: the fused sampler reads it as is, the torch path upcasts.
        logits = self.model.compute_logits(sample_hidden, upcast=False)
        sample_states = [states[i] for i in sample_rows]
        row_seeds = build_row_seeds(sample_states, self.model_config.seed,
                                    self._num_sampling_launches)
        self._num_sampling_launches += 1
        for state in sample_states:
            state.num_sampled += 1
        metadata = build_sampling_metadata(sample_states, self.sampling_staging,
                                           self.hf_config.vocab_size, row_seeds)
        sampler_output = self.sampler(logits, metadata)
        handle.set_samples(sample_rows, sample_states, sampler_output,
                           self._sampled_host[self._launch_parity])

    # ---- internals -----------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.block_tables.release_row(state.row)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            row = self.block_tables.add_row()
            self.block_tables.append(row, new.block_ids)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                generator=generator,
                row=row,
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                self.block_tables.replace(state.row, cached.new_block_ids)
            elif cached.new_block_ids:
                self.block_tables.append(state.row, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput, allow_graph: bool = True) -> StepInputs:
        req_ids = [r.req_id for r in so.scheduled_new_reqs]
        req_ids += [r.req_id for r in so.scheduled_cached_reqs]
        states = [self.requests[r] for r in req_ids]
        num_reqs = len(states)
        num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int64,
                                    num_reqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)
        rows = np.fromiter((s.row for s in states), np.int64, num_reqs)
        num_tokens = int(num_scheduled.sum())
        spec_tokens = so.scheduled_spec_decode_tokens
        drafts = [spec_tokens.get(r, []) for r in req_ids] if spec_tokens else []
        num_drafts = (np.fromiter(map(len, drafts), np.int64, num_reqs) if drafts
                      else np.zeros(num_reqs, dtype=np.int64))
        # Tokens each request occupies in the flattened step: its scheduled ones, or 1 + k for
        # every request of a verification step that replays a CUDA graph.
        layout = num_scheduled
        verify_size = None
        if allow_graph:
            verify_size = self._verify_graph_size(states, num_computed, num_scheduled,
                                                  num_drafts)
        if verify_size is not None:
            layout = np.full(num_reqs, self.spec.query_len, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(layout, out=query_start_loc[1:])
        num_layout_tokens = int(query_start_loc[-1])

        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the last step's copies have left the buffers
        # A token sampled by a step still in flight is only on the device: a 0 stands in for it
        # here and the device copy is patched in after the upload.
        pending: dict[StepHandle, tuple[list[int], list[int]]] = {}
        chunks = []
        for i, (s, c, n) in enumerate(zip(states, num_computed.tolist(),
                                          num_scheduled.tolist())):
            if c + n <= len(s.token_ids):
                chunks.append(s.token_ids[c:c + n])
            elif drafts and drafts[i]:
                chunks.append(s.token_ids[c:] + drafts[i])
            else:
                assert c + n == len(s.token_ids) + 1 and s.pending_step is not None, s.req_id
                chunks.append(s.token_ids[c:] + [0])
                dst, src = pending.setdefault(s.pending_step, ([], []))
                dst.append(int(query_start_loc[i]) + n - 1)
                src.append(s.pending_index)
        ordered = num_layout_tokens == num_reqs
        if ordered:  # all decodes: one token each at num_computed
            positions = num_computed
            req_of_token = np.arange(num_reqs)
            # Longest context first: the attention kernel starts its programs in this order,
            # so the longest requests do not make the tail of the launch.
            self.buf_decode_order.np[:num_reqs] = np.argsort(-num_computed, kind="stable")
        else:
            req_of_token = np.repeat(np.arange(num_reqs), layout)
            within = np.arange(num_layout_tokens) - query_start_loc[req_of_token]
            positions = num_computed[req_of_token] + within
        table = self.block_tables.table
        block_of_token = table[rows[req_of_token], positions // self.block_size]
        slots = block_of_token.astype(np.int64) * self.block_size + positions % self.block_size
        if verify_size is not None:
            # Padding after a request's real tokens: token 0, nothing stored.
            is_real = within < num_scheduled[req_of_token]
            slots[~is_real] = -1
            self.buf_input_ids.np[:num_layout_tokens] = 0
            self.buf_input_ids.np[:num_layout_tokens][is_real] = np.fromiter(
                itertools.chain.from_iterable(chunks), np.int64, num_tokens)
        else:
            self.buf_input_ids.np[:num_tokens] = np.fromiter(
                itertools.chain.from_iterable(chunks), np.int64, num_tokens)
        self.buf_positions.np[:num_layout_tokens] = positions
        self.buf_slot_mapping.np[:num_layout_tokens] = slots
        self.buf_query_start_loc.np[:num_reqs + 1] = query_start_loc
        self.buf_seq_lens.np[:num_reqs] = num_computed + layout
        width = int(self.block_tables.num_blocks[rows].max())
        compact = self.buf_block_tables.np[:num_reqs * width].reshape(num_reqs, width)
        compact[:] = table[rows, :width]

        graph = None
        padded_reqs, padded_tokens = num_reqs, num_layout_tokens
        if verify_size is not None:
            q = self.spec.query_len
            graph = (self.verify_graphs, verify_size)
            padded_reqs, padded_tokens = verify_size, verify_size * q
            # Padding requests: q tokens of nothing over no stored context.
            self.buf_seq_lens.np[num_reqs:verify_size] = q
            self.buf_query_start_loc.np[num_reqs + 1:verify_size + 1] = q * np.arange(
                num_reqs + 1, verify_size + 1)
        elif not allow_graph:
            pass
        elif self.graphs is not None and num_tokens == num_reqs:
            size = self.graphs.padded_size(num_reqs)
            if size is not None:
                graph = (self.graphs, size)
                padded_reqs = padded_tokens = size
                # Padding rows: no token to store, no context, the null block; ordered last.
                self.buf_seq_lens.np[num_reqs:size] = 0
                self.buf_query_start_loc.np[num_reqs + 1:size + 1] = np.arange(
                    num_reqs + 1, size + 1)
                self.buf_decode_order.np[num_reqs:size] = np.arange(num_reqs, size)
        elif self.prefill_graphs is not None and num_reqs == 1 and not pending:
            size = self.prefill_graphs.padded_size(num_tokens)
            if size is not None:
                graph = (self.prefill_graphs, size)
                padded_tokens = size  # tokens past query_start_loc[1] are padding
        if (graph is None and verify_size is None and allow_graph and self.mixed_graphs is not None
                and num_tokens > num_reqs and num_reqs <= self.mixed_graph_reqs):
            size = self.mixed_graphs.padded_size(num_tokens)
            if size is not None:
                graph = (self.mixed_graphs, size)
                padded_reqs, padded_tokens = self.mixed_graph_reqs, size
                # Padding requests: no queries (they start where the real tokens end), no
                # context; the tokens after the real ones belong to none and come out as zeros.
                self.buf_seq_lens.np[num_reqs:padded_reqs] = 0
                self.buf_query_start_loc.np[num_reqs + 1:padded_reqs + 1] = num_tokens
        if graph is not None:
            self.buf_input_ids.np[num_layout_tokens:padded_tokens] = 0
            self.buf_positions.np[num_layout_tokens:padded_tokens] = 0
            self.buf_slot_mapping.np[num_layout_tokens:padded_tokens] = -1
        # Pending tokens: per step in flight, (destinations, sources) side by side.
        pending_spans = []
        start = 0
        for handle, (dst, src) in pending.items():
            count = len(dst)
            self.buf_pending.np[start:start + count] = dst
            self.buf_pending.np[start + count:start + 2 * count] = src
            pending_spans.append((handle, start, count))
            start += 2 * count
        self._upload_inputs(num_reqs * width, padded_tokens)
        block_tables = self.buf_block_tables.device[:num_reqs * width].view(num_reqs, width)
        if graph is not None:
            # Padding rows keep whatever they held: with no context they read nothing.
            self.graph_block_tables[:num_reqs, :width].copy_(block_tables)
        for handle, start, count in pending_spans:
            index = self.buf_pending.device[start:start + 2 * count]
            self.buf_input_ids.device.index_copy_(0, index[:count], handle.sampled[index[count:]])
        if self.device.type == "cuda":
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        return StepInputs(req_ids, states, num_tokens, num_computed, num_scheduled,
                          query_start_loc, num_drafts, drafts, block_tables, graph, ordered)

    # Past this many unused bytes between the per-token arrays' used parts, they travel in
    # three copies rather than one (a full 8,192-token budget wastes 128 KiB at decode).
    _MAX_WASTED_UPLOAD_BYTES = 256 * 1024

    def _upload_inputs(self, block_table_entries: int, num_tokens: int) -> None:
        """This step's inputs to the device without blocking: query_start_loc through the
        block tables (whole small buffers, the tables' first entries) in one copy, input ids
        through slot mapping in another (three when that span is mostly unused)."""
        arena = self.inputs_arena
        arena.copy_span(self.buf_query_start_loc, self.buf_block_tables, block_table_entries)
        token_bytes = num_tokens * self.buf_input_ids.cpu.element_size()
        span = arena.span_bytes(self.buf_input_ids, self.buf_slot_mapping, num_tokens)
        if span - 3 * token_bytes <= self._MAX_WASTED_UPLOAD_BYTES:
            arena.copy_span(self.buf_input_ids, self.buf_slot_mapping, num_tokens)
        else:
            for buf in (self.buf_input_ids, self.buf_positions, self.buf_slot_mapping):
                buf.to_device(num_tokens)

    def _verify_graph_size(self, states: list[CachedRequestState], num_computed: np.ndarray,
                           num_scheduled: np.ndarray, num_drafts: np.ndarray) -> int | None:
        """The verification graph to replay: every request a decode with drafts to verify
        (each padded to 1 + k tokens, still within max_model_len), and a size captured."""
        if self.verify_graphs is None or not num_drafts.any():
            return None
        q = self.spec.query_len
        known = np.fromiter((len(s.token_ids) for s in states), np.int64, len(states))
        if ((num_computed + 1 != known).any() or (num_scheduled != 1 + num_drafts).any()
                or (num_computed + q > self.scheduler_config.max_model_len).any()):
            return None
        return self.verify_graphs.padded_size(len(states))

    def _metadata(self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
                  block_tables: torch.Tensor,
                  decode_order: torch.Tensor | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=self.buf_query_start_loc.device[:num_reqs + 1],
            seq_lens=self.buf_seq_lens.device[:num_reqs],
            block_tables=block_tables,
            slot_mapping=self.buf_slot_mapping.device[:num_tokens],
            query_start_loc_cpu=self.buf_query_start_loc.cpu[:num_reqs + 1],
            seq_lens_cpu=self.buf_seq_lens.cpu[:num_reqs],
            decode_order=decode_order,
        )

    def _compute_prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor,
                                 output: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1, from the positions computed this step."""
        for i, state in enumerate(step.states):
            num_logprobs = state.sampling_params.prompt_logprobs
            if num_logprobs is None or state.num_prompt_logprobs_sent >= state.num_prompt_tokens:
                continue
            # Prompt token t is predicted by position t - 1.
            start = int(step.num_computed[i])
            lo = max(state.num_prompt_logprobs_sent, start + 1, 1)
            hi = min(start + int(step.num_scheduled[i]) + 1, state.num_prompt_tokens)
            entries: list[PositionLogprobs | None] = []
            if state.num_prompt_logprobs_sent == 0:
                entries.append(None)
            if hi > lo:
                first_row = int(step.query_start_loc[i]) + (lo - 1 - start)
                logits = self.model.compute_logits(hidden[first_row:first_row + hi - lo])
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(state.token_ids[lo:hi], device=self.device)
                ids, lps, ranks = compute_topk_logprobs(logprobs, num_logprobs, targets)
                for row_ids, row_lps, rank in zip(ids.tolist(), lps.tolist(), ranks.tolist()):
                    entries.append(position_logprobs(row_ids, row_lps, rank, num_logprobs))
            if entries:
                state.num_prompt_logprobs_sent = max(state.num_prompt_logprobs_sent, 1, hi)
                output.prompt_logprobs[state.req_id] = entries


def _needs_token_history(params: SamplingParams) -> bool:
    return bool(params.min_tokens or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)
