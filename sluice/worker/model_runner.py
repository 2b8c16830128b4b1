"""SchedulerOutput in, one forward pass, ModelRunnerOutput out.

The runner keeps each request's state (token ids, block-table row, sampling generator) from the
step it first appears until it shows up in `finished_req_ids`; preempted requests keep their
state (so a seeded generator continues where it stopped) and get a fresh block table on resume.
It never decides policy: which tokens to compute comes entirely from the scheduler.

Per step: the InputBuilder (step_inputs.py) builds the inputs on the host and copies them to fixed
device buffers without blocking; the step replays a CUDA graph when the GraphRunner
(graph_runner.py) has one that fits it, else runs eagerly; only the rows that reach the end of
their known tokens are sampled, the sampled ids read back asynchronously (step_handle.py).

Lifecycle: construction loads the model (and a proposer's); the engine sizes the KV cache
(`determine_num_blocks`), then `initialize_kv_cache` allocates and binds it
(`kv_caches: {layer_name: tensor}`), warms up and captures the graphs; then `launch` per step
until `shutdown` drops every device tensor.

With speculative decoding (see sluice/worker/spec_decode.py) a request's drafts ride at the end
of its scheduled tokens; a step with drafts, and every step of a model proposer, then runs
synchronously: verify, append, propose. An n-gram step without drafts samples like any step
(the scheduler proposes n-gram drafts), so it can overlap the next. With async scheduling,
drafts are proposed on the device instead (n-gram: sluice/spec_decode/device_ngram.py; a model
proposer's pass after each step: sluice/spec_decode/model_proposer.py) and a step that verifies
them overlaps the next like any other.
"""

from __future__ import annotations

import gc

import numpy as np
import torch

from sluice.attention import get_attention_backend
from sluice.attention.kv_layout import (
    KVCacheAllocator,
    allocate_kv_caches,
    kv_bytes,
    resolve_kv_cache_dtype,
)
from sluice.config import CacheConfig, ModelConfig, SchedulerConfig
from sluice.core.kv_cache_groups import KVCacheGroups, one_group
from sluice.core.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    GrammarBitmask,
    KVConnectorOutput,
    ModelRunnerOutput,
    PositionLogprobs,
    SchedulerOutput,
)
from sluice.distributed.head_split import kv_heads_per_rank
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import HFModelConfig
from sluice.model.loader import load_model, resolve_dtype
from sluice.sample.sampler import Sampler, compute_topk_logprobs
from sluice.sampling_params import SamplingParams
from sluice.worker.graph_runner import GraphRunner
from sluice.worker.input_batch import CachedRequestState, StagedBuffer
from sluice.worker.kv_cache import determine_num_blocks
from sluice.worker.kv_connector import KVConnectorWorker
from sluice.worker.layer_events import GraphLayerEvents
from sluice.worker.sampling_inputs import (
    GrammarStaging,
    SamplingMetadataReuse,
    SamplingStaging,
    build_row_seeds,
    build_sampling_metadata,
)
from sluice.worker.spec_decode import SpecDecoder
from sluice.worker.step_handle import StepHandle, position_logprobs
from sluice.worker.step_inputs import InputBuilder, StepInputs


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device(device)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, hf_config: HFModelConfig,
                 tp: TPGroup = SINGLE_RANK, kv_groups: KVCacheGroups | None = None) -> None:
        """tp: this rank's tensor-parallel group; the model is this rank's shard of it, its KV
        cache this rank's heads (tensor parallelism: sluice/distributed/tp.py). kv_groups: the
        model's KV cache groups (sluice/core/kv_cache_groups.py; None: one of every layer)."""
        self.model_config = model_config
        self.tp = tp
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.hf_config = hf_config
        self.kv_groups = (kv_groups if kv_groups is not None
                          else one_group(hf_config.num_hidden_layers, None))
        self.device = resolve_device(model_config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            if tp.size > 1:
                raise ValueError(f"device {model_config.device!r} names one GPU, but tensor "
                                 f"parallelism over {tp.size} ranks takes a GPU per rank: "
                                 "give --device cuda and choose the GPUs with "
                                 "CUDA_VISIBLE_DEVICES")
            # cuda:N: streams, graphs and kernels of this process default to that GPU.
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(model_config.dtype, hf_config)
        self.kv_cache_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, self.dtype)
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
                                self.attn_backend, tp)
        self.spec: SpecDecoder | None = None
        if scheduler_config.speculative_config is not None:
            self.spec = SpecDecoder(self, scheduler_config.speculative_config)
        if self.device.type == "cuda":
            gpu_share -= torch.cuda.memory_allocated(self.device) - allocated_before
            from sluice.worker.compile import install_fp8_ops

            install_fp8_ops(self.model)
            if not model_config.enforce_eager:
                from sluice.worker.compile import install_fused_ops

                install_fused_ops(self.model)
                if self.spec is not None and self.spec.model_proposer is not None:
                    install_fused_ops(self.spec.model_proposer.model)
        self.gpu_bytes_available = gpu_share

        self.requests: dict[str, CachedRequestState] = {}
        max_num_reqs = scheduler_config.max_num_seqs
        max_blocks_per_req = -(-scheduler_config.max_model_len // self.block_size)
        max_tokens = max(scheduler_config.max_num_batched_tokens, max_num_reqs)
        dev = self.device
        self.input_builder = InputBuilder(max_num_reqs, max_tokens, max_blocks_per_req,
                                          self.block_size, dev, self.kv_groups.num_groups)
        # The host block tables: a row per live request, taken and released in _update_states.
        self.block_tables = self.input_builder.block_tables
        self.graph_runner = GraphRunner(self.input_builder, scheduler_config,
                                        self.spec.query_len if self.spec is not None else None)
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
        self.sampling_reuse = SamplingMetadataReuse(self.sampling_staging)
        self.grammar_staging = GrammarStaging(max_num_reqs, dev)  # structured outputs
        self._num_sampling_launches = 0  # keys the fused sampler's unseeded rows
        self._last_step: StepHandle | None = None
        # {layer_name: [2, num_blocks, block_size, KVH, D]} in layer order (kv_layout)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._connector_caches: dict[str, torch.Tensor] = {}
        self.num_blocks = 0
        # This rank's half of the KV connector, if one is configured (set by the Worker), and
        # the per-layer events its graphs were captured with.
        self.kv_connector: KVConnectorWorker | None = None
        self.layer_events: GraphLayerEvents | None = None

    def shutdown(self) -> None:
        """Drop every device tensor this runner holds (see EngineCore.shutdown)."""
        self.kv_connector = None
        self.layer_events = None
        self.graph_runner.clear()
        self._last_step = None
        self.spec = None
        self.requests.clear()
        self.kv_caches = {}
        self._connector_caches = {}
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()
            torch.cuda.empty_cache()

    # ---- KV cache ------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        extra = self.spec.kv_bytes_per_block() if self.spec is not None else 0
        return determine_num_blocks(self.cache_config, self.scheduler_config, self.hf_config,
                                    self.kv_cache_dtype, self.device, self.gpu_bytes_available,
                                    extra_bytes_per_block=extra, tp_size=self.tp.size,
                                    kv_groups=self.kv_groups)

    def initialize_kv_cache(self, num_blocks: int, with_connector: bool = False,
                            allocator: KVCacheAllocator | None = None) -> None:
        """Allocate (through a KV connector's `allocator`, if any) and bind the cache, warm up,
        capture the graphs (with the per-layer events of a KV connector when `with_connector`:
        sluice/worker/layer_events.py)."""
        hf = self.hf_config
        layers = attention_layers(self.model)
        names = list(layers)
        groups = self.kv_groups
        # One tensor per layer, or per layer of a group (named after group 0's layers) where
        # the model's layers are split into KV cache groups: layer j of every group shares
        # tensor j.
        caches = allocate_kv_caches(names if groups.num_groups == 1
                                    else [names[i] for i in groups.layers[0]],
                                    num_blocks, self.block_size,
                                    kv_heads_per_rank(hf.num_key_value_heads, self.tp.size),
                                    hf.head_dim, self.kv_cache_dtype, self.device, allocator)
        if groups.num_groups > 1:
            tensors = list(caches.values())
            slots = groups.layer_slots()
            assert len(slots) == len(names), (len(slots), names)
            caches = {name: tensors[slots[i][1]] for i, name in enumerate(names)}
            for i, layer in enumerate(layers.values()):
                layer.kv_group = slots[i][0]
        self.kv_caches = caches
        bind_kv_caches(self.model, self.kv_caches)
        self._connector_caches = {name: kv_bytes(kv) for name, kv in self.kv_caches.items()}
        self.num_blocks = num_blocks
        self.input_builder.dense_prefill = self._backend_supports("supports_dense_prefill")
        self.input_builder.dense_prefix = self._backend_supports("supports_dense_prefix")
        graphs = (self.device.type == "cuda" and not self.model_config.enforce_eager
                  and getattr(self.attn_backend, "supports_cuda_graphs", False))
        if self.spec is not None:
            self.spec.initialize_kv_cache(num_blocks, capture_graphs=graphs)
        if self.device.type == "cuda":
            self.graph_runner.warm_up(self.model, self.sampler)
        if graphs:
            if self.spec is not None:
                self.graph_runner.after_forward = self.spec.hidden_store()
            if with_connector:
                self.layer_events = GraphLayerEvents(list(self.kv_caches), self.device)
            self.graph_runner.capture(self.model, self.layer_events)

    def connector_kv_caches(self) -> dict[str, torch.Tensor]:
        """The caches as a KV connector is given them (an 8-bit cache as bytes: kv_bytes),
        made once with the cache (a graph replay with saves hands them over every step)."""
        return self._connector_caches

    def _backend_supports(self, question: str) -> bool:
        """The attention backend's answer to an optional `supports_dense_prefill` /
        `supports_dense_prefix` (steps of one prompt that may run dense attention), asked for
        this rank's heads; False where it has no such method or `--no-dense-prefill`."""
        supports = getattr(self.attn_backend, question, None)
        layers = list(attention_layers(self.model).values())
        if supports is None or not layers or not self.model_config.dense_prefill:
            return False
        layer = layers[0]
        return supports(self.device, self.dtype, layer.num_heads, layer.num_kv_heads,
                        layer.head_dim)

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
        if connector is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            connector.start_load_kv()
        if scheduler_output.is_empty:
            if connector is None:
                return StepHandle(EMPTY_MODEL_RUNNER_OUTPUT, previous)
            output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            self._end_connector_step(scheduler_output, output, None)
            return StepHandle(output, previous)
        if previous is not None and any(
                s.pending_step is not None and _needs_token_history(s.sampling_params)
                for s in (self.requests[r] for r in scheduler_output.num_scheduled_tokens)):
            previous.result()  # penalties and min_tokens count tokens on the host
        draft_fix_up = self.spec.draft_fix_up if self.spec is not None else None
        step = self.input_builder.prepare(scheduler_output, self.requests, self.graph_runner,
                                          draft_fix_up)
        if step.graph is not None:
            graphs, size = step.graph
            # A connector's per-layer work around the replay, through the events the graphs
            # were captured with.
            if connector is not None and connector.has_loads():
                self.layer_events.before_replay(connector)
            hidden = graphs.replay(size)  # [padded tokens, H]
            if connector is not None and connector.has_saves():
                self.layer_events.after_replay(connector, self.connector_kv_caches())
        else:
            input_ids, positions, metadata = self.input_builder.eager_inputs(step)
            metadata.kv_hooks = connector  # the layers call its per-layer hooks (or None)
            hidden = self.model(input_ids, positions, metadata)  # [T, H]

        states = step.states
        seq_lens = (step.num_computed + step.num_scheduled - step.num_drafts).tolist()
        output = ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=[[] for _ in states])
        handle = StepHandle(output, previous)
        self._last_step = handle
        self._compute_prompt_logprobs(step, hidden, output)
        # A request samples once its chunk reaches the end of its tokens (known or in flight);
        # a device row always does.
        device_rows = step.device_rows
        sample_rows = [i for i, s in enumerate(states)
                       if (device_rows is not None and device_rows[i])
                       or seq_lens[i] == len(s.token_ids) + (s.pending_step is not None)]
        if connector is not None:
            failed = self._end_connector_step(scheduler_output, output, step)
            if failed:
                # Their KV is partly garbage: nothing computed over it is handed out; the
                # scheduler recomputes from the first bad block (or fails the request). (Loads
                # never serve requests that want prompt logprobs: those skip every cache.)
                sample_rows = [i for i in sample_rows if i not in failed]
        if device_rows is not None:
            for i in np.flatnonzero(device_rows):
                states[i].history_step = handle  # its history now lacks this step's tokens
        if self.spec is not None:
            self.spec.sample_step(step, hidden, sample_rows, handle, scheduler_output)
        else:
            self.sample(step, hidden, sample_rows, handle, scheduler_output.grammar_bitmask)
        return handle

    def _end_connector_step(self, scheduler_output: SchedulerOutput,
                            output: ModelRunnerOutput, step: StepInputs | None) -> set[int]:
        """The connector's end of a step (its saves were issued per layer): completions and
        load errors into the step's output. Returns the rows of `step` whose blocks failed to
        load."""
        connector = self.kv_connector
        connector.wait_for_save()
        # Completions before errors: a connector records a load's errors before its end.
        finished_sending, finished_recving = connector.get_finished(
            scheduler_output.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        output.kv_connector_output = KVConnectorOutput(
            finished_sending=set(finished_sending), finished_recving=set(finished_recving),
            invalid_block_ids=set(invalid), first_tokens=connector.get_first_tokens(),
            load_errors=connector.get_load_errors(), stats=connector.get_stats(),
            ready_requests=connector.get_ready_requests())
        connector.clear_connector_metadata()
        if not invalid or step is None:
            return set()
        table, num_blocks = self.block_tables.table, self.block_tables.num_blocks
        return {i for i, state in enumerate(step.states)
                if invalid.intersection(table[state.row, :num_blocks[state.row]].tolist())}

    def sample(self, step: StepInputs, hidden: torch.Tensor, sample_rows: list[int],
               handle: StepHandle, grammar: GrammarBitmask | None = None) -> None:
        """Sample one token for each row of `sample_rows` (queued on the device); `grammar`:
        the step's structured-output masks."""
        if not sample_rows:
            return
        states = step.states
        parity = self.next_launch_parity()
        if step.num_tokens == len(states) and len(sample_rows) == len(states):
            sample_hidden = hidden[:len(states)]  # all decodes, all sampling
        else:
            indices = self.buf_logits_indices[parity]
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
        metadata = self.sampling_reuse.get(sample_states, row_seeds, grammar)
        if metadata is None:
            metadata = build_sampling_metadata(sample_states, self.sampling_staging,
                                               self.hf_config.vocab_size, row_seeds,
                                               grammar, self.grammar_staging)
            self.sampling_reuse.keep(sample_states, metadata)
        sampler_output = self.sampler(logits, metadata)
        handle.set_samples(sample_rows, sample_states, sampler_output,
                           self._sampled_host[parity])

    def next_launch_parity(self) -> int:
        """Which of the two staging buffers of each kind the next sampling launch writes (they
        alternate: see __init__)."""
        self._launch_parity ^= 1
        return self._launch_parity

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
                if not params.greedy:
                    # Tokens drawn elsewhere from this seed (a prefill instance's first
                    # token): draw as many here, so the next draw is a colocated engine's.
                    for _ in new.output_token_ids:
                        torch.empty(self.hf_config.vocab_size, device=self.device).exponential_(
                            generator=generator)
            row = self.block_tables.add_row()
            self.block_tables.append(row, new.block_ids, new.group_block_ids)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                generator=generator,
                row=row,
                num_computed_tokens=new.num_computed_tokens,
                # A first token sampled elsewhere counts as a draw (seeded rows key on it).
                num_sampled=len(new.output_token_ids),
            )
            if self.spec is not None:
                self.spec.start_request(self.requests[new.req_id], new.num_loaded_tokens)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                self.block_tables.replace(state.row, cached.new_block_ids,
                                          cached.new_group_block_ids)
            elif cached.new_block_ids:
                self.block_tables.append(state.row, cached.new_block_ids,
                                         cached.new_group_block_ids)
                if self.spec is not None:
                    self.spec.fresh_blocks(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.resumed_from_preemption and self.spec is not None:
                self.spec.start_request(state, cached.num_loaded_tokens)

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
