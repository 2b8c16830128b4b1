"""One step's model inputs: built on the host from the runner's request states, copied to fixed
device buffers without blocking.

The InputBuilder owns the host block tables (a row per live request: the runner takes a row when it
first sees a request and releases it when the request finishes) and every persistent input
buffer: one StagedArena of pinned host memory with its device twin, so a step's inputs travel in
two copies (see upload), and, on a GPU, the full-width block table that CUDA graphs read.

Per step (`prepare`): positions, slots and input ids are computed with numpy into the pinned
buffers; the GraphRunner says whether a CUDA graph replays the step (and pads its requests and
tokens to the graph's size); the buffers are uploaded; tokens a step still in flight sampled
(async scheduling) are patched into the input ids on the device. Rows whose drafts the device
proposes, or that follow a step that verified such drafts, are fixed on the device instead
(sluice/spec_decode/device_ngram.py). The next step's host writes wait for this step's copies to
leave the buffers (one event), never for the device to finish the step.
Buffers are written and read by the runner's thread only, one step at a time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from sluice.attention import AttentionMetadata
from sluice.core.outputs import SchedulerOutput
from sluice.spec_decode.device_ngram import META_COLUMNS, DeviceNgram, StepBuffers
from sluice.worker.cuda_graphs import DecodeGraphs
from sluice.worker.input_batch import BlockTables, CachedRequestState, StagedArena
from sluice.worker.step_handle import StepHandle

if TYPE_CHECKING:
    from sluice.worker.graph_runner import GraphRunner


@dataclass(slots=True)
class StepInputs:
    req_ids: list[str]
    states: list[CachedRequestState]
    num_tokens: int
    num_computed: np.ndarray  # [B] before this step
    rows: np.ndarray  # [B] each request's block-table row
    num_scheduled: np.ndarray  # [B]
    # [B + 1] where each request's tokens start in the step's flattened tokens (a verification
    # CUDA graph lays requests out every 1 + k tokens, padding after the real ones)
    query_start_loc: np.ndarray
    num_drafts: np.ndarray  # [B] draft tokens at the end of each request's scheduled tokens
    drafts: list[list[int]]  # [B] each request's drafts; [] for a step without any
    block_tables: torch.Tensor  # [B, most blocks of any request], on the device
    graph: tuple[DecodeGraphs, int] | None  # the CUDA graph to replay (graph set, size), if any
    ordered: bool  # a decode batch: buf_decode_order holds its longest-first order
    # One request's prompt (chunk) whose attention may run dense (AttentionMetadata.
    # dense_prefill): over no cached context, or over a prefix (then eagerly).
    dense_prefill: bool = False
    # Device n-gram rows (fixed on the device): [B] bool, their draft slots [B], and the
    # drafts the fix-up proposed ([B, k] ids, [B] counts, on the device); None without any.
    device_rows: np.ndarray | None = None
    draft_slots: np.ndarray | None = None
    device_drafts: tuple[torch.Tensor, torch.Tensor] | None = None
    # A hybrid model's KV cache groups 1..: (block tables, slots) on the device, as
    # block_tables and the slot mapping are group 0's (AttentionMetadata.group_tables).
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


class InputBuilder:
    # Past this many unused bytes between the per-token arrays' used parts, they travel in
    # three copies rather than one (a full 8,192-token budget wastes 128 KiB at decode).
    _MAX_WASTED_UPLOAD_BYTES = 256 * 1024

    def __init__(self, max_num_reqs: int, max_tokens: int, max_blocks_per_req: int,
                 block_size: int, device: torch.device, num_groups: int = 1) -> None:
        """num_groups: KV cache groups, each with its block tables and slots (a hybrid
        model's: sluice/core/kv_cache_groups.py); 1 for every other model."""
        self.block_size = block_size
        self.device = device
        self.num_groups = num_groups
        self.block_tables = BlockTables(max_blocks_per_req, initial_rows=max_num_reqs,
                                        num_groups=num_groups)
        # One step's inputs, in the order they travel: the per-request arrays and the block
        # tables (compact, [groups, B, width] of this step) in one copy, the per-token arrays
        # in another (see upload). CUDA graphs read the block tables from a fixed full-width
        # table, filled on the device.
        specs = {
            "query_start_loc": ((max_num_reqs + 1,), torch.int32),
            "seq_lens": ((max_num_reqs,), torch.int32),
            # A decode batch's requests, longest context first (AttentionMetadata.decode_order).
            "decode_order": ((max_num_reqs,), torch.int32),
            # Where tokens still in flight go in this step's input ids: (destination, source).
            "pending": ((2 * max_num_reqs,), torch.int64),
            "block_tables": ((num_groups * max_num_reqs * max_blocks_per_req,), torch.int32),
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
        }
        if num_groups > 1:
            # Groups 1..'s slots, [groups - 1, T] for a step of T (padded) tokens.
            specs["group_slot_mapping"] = (((num_groups - 1) * max_tokens,), torch.int64)
        arena = StagedArena(specs, device)
        self.arena = arena
        self.buf_query_start_loc = arena.buffers["query_start_loc"]
        self.buf_seq_lens = arena.buffers["seq_lens"]
        self.buf_decode_order = arena.buffers["decode_order"]
        self.buf_pending = arena.buffers["pending"]
        self.buf_block_tables = arena.buffers["block_tables"]
        self.buf_input_ids = arena.buffers["input_ids"]
        self.buf_positions = arena.buffers["positions"]
        self.buf_slot_mapping = arena.buffers["slot_mapping"]
        self.buf_group_slot_mapping = arena.buffers.get("group_slot_mapping")
        # [groups, max_num_reqs, max_blocks_per_req] int32: what every CUDA graph was captured
        # reading (graph_block_tables: group 0's)
        self.graph_group_block_tables = (
            torch.zeros((num_groups, max_num_reqs, max_blocks_per_req), dtype=torch.int32,
                        device=device)
            if device.type == "cuda" else None)
        self.graph_block_tables = (self.graph_group_block_tables[0]
                                   if self.graph_group_block_tables is not None else None)
        self._inputs_copied: torch.cuda.Event | None = None
        # A step that is one prompt over no cached context is marked for dense attention
        # (AttentionMetadata.dense_prefill), and one long chunk over a cached prefix
        # (dense_prefix): set by the runner where its backend supports them.
        self.dense_prefill = False
        self.dense_prefix = False

    def prepare(self, so: SchedulerOutput, requests: dict[str, CachedRequestState],
                graphs: GraphRunner, draft_fix_up: DeviceNgram | None = None) -> StepInputs:
        """This step's inputs, on the device (or queued to it) when this returns.
        draft_fix_up: the runner's, with drafts proposed on the device."""
        req_ids = [r.req_id for r in so.scheduled_new_reqs]
        req_ids += [r.req_id for r in so.scheduled_cached_reqs]
        states = [requests[r] for r in req_ids]
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
        device_rows = None
        if draft_fix_up is not None:
            # A row the device fixes: its drafts come from the device, or its last tokens are
            # those of a step in flight that verified drafts (how many is on the device only).
            slots = so.scheduled_device_drafts
            device_rows = np.fromiter(
                (r in slots or (s.pending_step is not None and s.pending_step.verified
                                is not None) for r, s in zip(req_ids, states)), bool, num_reqs)
            if device_rows.any():
                num_drafts = np.fromiter((slots.get(r, 0) for r in req_ids), np.int64,
                                         num_reqs)
            else:
                device_rows = None
        # Tokens each request occupies in the flattened step: its scheduled ones, or 1 + k for
        # every request of a verification step that replays a CUDA graph.
        layout = num_scheduled
        # Only a step with drafts can replay a verification graph (drafting off: never asked).
        verify_size = (graphs.verify_size(states, num_computed, num_scheduled, num_drafts,
                                          device_rows)
                       if drafts or num_drafts.any() else None)
        if verify_size is not None:
            layout = np.full(num_reqs, graphs.query_len, dtype=np.int64)
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
            if device_rows is not None and device_rows[i]:
                assert n == 1 + num_drafts[i], (s.req_id, n, num_drafts[i])
                chunks.append([0] * n)  # written by the fix-up
            elif c + n <= len(s.token_ids):
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
        num_groups = self.num_groups
        if num_groups == 1:
            compact = self.buf_block_tables.np[:num_reqs * width].reshape(num_reqs, width)
            compact[:] = table[rows, :width]
        else:
            # [groups, B, width], and groups 1..'s slots of each token (spec decoding, whose
            # padded layouts these do not handle, keeps one group)
            tables = self.block_tables.tables
            self.buf_block_tables.np[:num_groups * num_reqs * width].reshape(
                num_groups, num_reqs, width)[:] = tables[:, rows, :width]
            group_slots = (tables[1:, rows[req_of_token], positions // self.block_size]
                           .astype(np.int64) * self.block_size + positions % self.block_size)

        lone = num_reqs == 1 and not pending and not drafts and device_rows is None
        fresh = self.dense_prefill and lone and num_computed[0] == 0
        over_prefix = (self.dense_prefix and lone and num_computed[0] > 0
                       and graphs.dense_over_prefix_pays(num_tokens, int(num_computed[0])))
        graph, padded_tokens = graphs.pad_for_graph(
            num_reqs, num_tokens, num_layout_tokens, verify_size,
            bool(pending) or device_rows is not None,
            int(self.buf_seq_lens.np[:num_reqs].max()), fresh=fresh, eager=over_prefix)
        # A fresh prompt runs dense only in the dense-prefill graphs, whose shapes are planned
        # (see graph_runner.DENSE_PREFIX_MAX_BYTES); eagerly it takes the paged kernel.
        fresh = fresh and graph is not None and graph[0] is graphs.dense_prefill_graphs
        # Pending tokens: per step in flight, (destinations, sources) side by side.
        pending_spans = []
        start = 0
        for handle, (dst, src) in pending.items():
            count = len(dst)
            self.buf_pending.np[start:start + count] = dst
            self.buf_pending.np[start + count:start + 2 * count] = src
            pending_spans.append((handle, start, count))
            start += 2 * count
        group_tables = ()
        if num_groups > 1:
            # Laid out [groups - 1, padded tokens]: a graph of that size was captured so.
            slots_by_group = self.buf_group_slot_mapping.np[
                :(num_groups - 1) * padded_tokens].reshape(num_groups - 1, padded_tokens)
            slots_by_group[:, :num_layout_tokens] = group_slots
            slots_by_group[:, num_layout_tokens:] = -1
            self.buf_group_slot_mapping.to_device((num_groups - 1) * padded_tokens)
            group_tables = self.compact_group_tables(num_reqs, width, padded_tokens)
        self.upload(num_groups * num_reqs * width, padded_tokens)
        block_tables = self.buf_block_tables.device[:num_reqs * width].view(num_reqs, width)
        if graph is not None:
            # Padding rows keep whatever they held: with no context they read nothing.
            if num_groups == 1:
                self.graph_block_tables[:num_reqs, :width].copy_(block_tables)
            else:
                self.graph_group_block_tables[:, :num_reqs, :width].copy_(
                    self.buf_block_tables.device[:num_groups * num_reqs * width].view(
                        num_groups, num_reqs, width))
        for handle, start, count in pending_spans:
            dst = self.buf_pending.np[start:start + count]
            src = self.buf_pending.np[start + count:start + 2 * count]
            if (count == len(handle.sampled) and src[0] == 0 and dst[-1] - dst[0] == count - 1
                    and (count == 1 or ((np.diff(src) == 1).all() and (np.diff(dst) == 1).all()))):
                # Steady decoding: every token the step in flight sampled, in its order, to
                # consecutive positions here: one copy instead of a gather and a scatter.
                first = int(dst[0])
                self.buf_input_ids.device[first:first + count].copy_(handle.sampled)
                continue
            index = self.buf_pending.device[start:start + 2 * count]
            self.buf_input_ids.device.index_copy_(0, index[:count], handle.sampled[index[count:]])
        device_drafts = None
        if device_rows is not None:
            device_drafts = self._fix_up_device_rows(draft_fix_up, states, device_rows,
                                                     num_drafts, query_start_loc, block_tables,
                                                     padded_tokens)
        if self.device.type == "cuda":
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        return StepInputs(req_ids, states, num_tokens, num_computed, rows, num_scheduled,
                          query_start_loc, num_drafts, drafts, block_tables, graph, ordered,
                          dense_prefill=fresh or over_prefix, device_rows=device_rows,
                          draft_slots=num_drafts if device_rows is not None else None,
                          device_drafts=device_drafts, group_tables=group_tables)

    def compact_group_tables(self, num_reqs: int, width: int, num_tokens: int
                             ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Groups 1..'s (block tables [num_reqs, width], slots [num_tokens]) in the device
        buffers, as a step of that shape lays them out; () for one group."""
        n = num_reqs * width
        return tuple((self.buf_block_tables.device[g * n:(g + 1) * n].view(num_reqs, width),
                      self.buf_group_slot_mapping.device[(g - 1) * num_tokens:g * num_tokens])
                     for g in range(1, self.num_groups))

    def graph_group_tables(self, num_reqs: int, num_tokens: int
                           ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Groups 1..'s (block tables, slots) a CUDA graph of `num_reqs` requests and
        `num_tokens` tokens is captured reading; () for one group."""
        return tuple((self.graph_group_block_tables[g, :num_reqs],
                      self.buf_group_slot_mapping.device[(g - 1) * num_tokens:g * num_tokens])
                     for g in range(1, self.num_groups))

    def _fix_up_device_rows(self, draft_fix_up: DeviceNgram,
                            states: list[CachedRequestState], device_rows: np.ndarray,
                            slots: np.ndarray, query_start_loc: np.ndarray,
                            block_tables: torch.Tensor,
                            num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the device rows' fix-up: histories not known to be current uploaded first
        (every token the host knows: all but those of the step in flight), then the kernel."""
        meta = np.zeros((len(states), META_COLUMNS), dtype=np.int64)
        upload_rows, upload_tokens = [], []
        previous = None
        for i, s in enumerate(states):
            meta[i, :4] = (s.row, -1, query_start_loc[i], slots[i])
            if not device_rows[i]:
                continue
            meta[i, 4] = 1
            if s.pending_step is not None:
                assert previous is None or s.pending_step is previous, s.req_id
                previous = s.pending_step
                meta[i, 1] = s.pending_index
            else:
                # Every token known here: the last one's position, against the scheduler's
                # count (which may still take drafts of a step taken here as accepted).
                meta[i, 5] = len(s.token_ids) - 1 - s.num_computed_tokens
            if s.pending_step is None or s.history_step is not s.pending_step:
                upload_rows.append(s.row)
                # (With a model's drafts the fix-up reads only a row's last token.)
                upload_tokens.append(s.token_ids[-1:] if draft_fix_up.from_model
                                     else s.token_ids)
        draft_fix_up.ensure_rows(int(meta[:, 0].max()) + 1)
        draft_fix_up.upload(upload_rows, upload_tokens)
        num_reqs = len(states)
        buffers = StepBuffers(self.buf_input_ids.device[:num_tokens],
                              self.buf_positions.device[:num_tokens],
                              self.buf_slot_mapping.device[:num_tokens],
                              self.buf_seq_lens.device[:num_reqs], block_tables)
        return draft_fix_up.fix_up(
            meta, previous.previous_tokens() if previous is not None else None, buffers)

    def upload(self, block_table_entries: int, num_tokens: int) -> None:
        """This step's inputs to the device without blocking: query_start_loc through the
        block tables (whole small buffers, the tables' first entries) in one copy, input ids
        through slot mapping in another (three when that span is mostly unused)."""
        arena = self.arena
        arena.copy_span(self.buf_query_start_loc, self.buf_block_tables, block_table_entries)
        token_bytes = num_tokens * self.buf_input_ids.cpu.element_size()
        span = arena.span_bytes(self.buf_input_ids, self.buf_slot_mapping, num_tokens)
        if span - 3 * token_bytes <= self._MAX_WASTED_UPLOAD_BYTES:
            arena.copy_span(self.buf_input_ids, self.buf_slot_mapping, num_tokens)
        else:
            for buf in (self.buf_input_ids, self.buf_positions, self.buf_slot_mapping):
                buf.to_device(num_tokens)

    def eager_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata]:
        """(input_ids [T], positions [T], metadata) of a step that runs without a graph."""
        num_reqs = len(step.states)
        metadata = self.metadata(
            num_reqs, step.num_tokens, max_query_len=int(step.num_scheduled.max()),
            max_seq_len=int((step.num_computed + step.num_scheduled).max()),
            block_tables=step.block_tables,
            decode_order=self.buf_decode_order.device[:num_reqs] if step.ordered else None,
            group_tables=step.group_tables)
        metadata.dense_prefill = step.dense_prefill
        return (self.buf_input_ids.device[:step.num_tokens],
                self.buf_positions.device[:step.num_tokens], metadata)

    def metadata(self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
                 block_tables: torch.Tensor,
                 decode_order: torch.Tensor | None = None,
                 group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
                 ) -> AttentionMetadata:
        """Attention metadata over the first `num_reqs` / `num_tokens` of the device buffers;
        group_tables: a hybrid model's groups 1.. (compact_group_tables, graph_group_tables)."""
        assert len(group_tables) == self.num_groups - 1, "every KV cache group's tables"
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
            group_tables=group_tables,
        )
