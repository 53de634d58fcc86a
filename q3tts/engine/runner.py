"""Everything that runs on the device: static caches, batched prefill, and the whole-frame decode step.

Slots are rows of the persistent batch (q3tts.engine.slots); the running requests occupy rows [0, B) (the engine
compacts with `move_slot`), so a frame reads and writes plain views of the caches; newcomers take rows [B, B+N).

One frame (`_frame(B, n)`) for rows [0, B), attending over the first n cache positions:
  1. code predictor (q3tts.engine.depth): fresh 2-token prefill [h, codec_embedding(code0)] -> code 1, then 14
     steps -> codes 2..15
  2. talker input = embed_codes(frame) + trailing_text[frame] (tts_pad once the text is used up)
  3. talker step at each row's position -> hidden h' -> codec_head -> rules -> sample next code 0
A row whose streamed text has not reached its next token sits the frame out (`active` False): computed with the others,
its state is left as it was, so it runs the same frame later. A frame has fixed shapes for fixed (B, n), reads no host
value and syncs nothing, so on CUDA it is two CUDA graphs replayed back to back with padding rows: steps 2-3, the
talker's half, one per (batch bucket, length bucket, sampler); step 1, the code predictor's, one per (batch bucket,
sampler), since it attends to no talker cache position (most of a frame's launches: captured once per batch and
sampler, not once per span too). One request's prefill is a graph too, per padded prompt length (PREFILL_GRAPH_LENS),
into a scratch cache row then copied into the request's row, with its code 0 drawn into its row by a device index
(q3tts.engine.graphs). A larger wave of newcomers replays one batched prefill graph per chunk of up to the largest wave
size (memory.PREFILL_WAVE_SIZES x PREFILL_WAVE_LENS), into a scratch cache of that many rows, alike.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from .. import invariant
from ..hostcopy import to_device
from ..inputs.request import InputError, PreparedRequest
from ..kernels import linear
from ..models.layers import ATTN_SCORES_CHUNK, AttnContext, rope_cos_sin, rope_inv_freq
from ..models.talker import Talker, embed_prompts
from ..sampling import SamplingParams, uniform_noise
from .compile import compile_model, use_compile_cache, want_compile
from .compile_helpers import HALVES, Source
from .depth import DepthLoop
from .graphs import capture_runner
from .memory import KV_SPARE, alloc_len, wave_buckets
from .scheduler import FrameResult
from .slots import Slots, alloc_kv
from .turn import device_wait

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MIN_KV_SPAN = 64
PREFILL_GRAPH_LENS = (16, 32, 64, 128, 256)  # one request's prefill is a captured graph up to these padded lengths
# Up to this many requests admitted in one step replay their prefill graphs one after another, each as alone (its bits
# those of its prefill alone), rather than share one wave graph (memory.PREFILL_WAVE_SIZES) or a batched forward: a
# few replays cost less than the least wave graph (timings: BENCHMARKS.md, "Batched prefill graphs")
PREFILL_GRAPH_MAX_REQUESTS = 10
log = logging.getLogger("q3tts.engine")


class ModelRunner:
    def __init__(self, talker: Talker, tts_pad_embed: torch.Tensor, max_slots: int, max_len: int,
                 use_cuda_graphs: bool | None = None, compile: bool | None = None, block_size: int | None = None,
                 num_blocks: int | None = None, compile_cache: str | bool | None = None):
        cfg, p = talker.cfg, next(talker.parameters())
        self.device, self.dtype = dev, dt = p.device, p.dtype
        self.talker, self.cfg, self.K = talker, cfg, cfg.num_code_groups
        self.max_len = alloc_len(max_len, MIN_KV_SPAN)  # a power of two: the last length bucket
        self.use_graphs = (dev.type == "cuda") if use_cuda_graphs is None else use_cuda_graphs
        # graph batch buckets: powers of two below max_slots, then max_slots (a padded replay stays inside the slots)
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_slots) + (max_slots,)
        S = self.num_rows = max_slots
        self.block_size = block_size  # paged KV cache: positions per block (None: max_len positions per slot)
        assert not block_size or MIN_KV_SPAN % block_size == 0, "every attended span must be whole blocks"
        self.kv, self.num_blocks = alloc_kv(cfg, S, self.max_len, block_size, num_blocks, dev, dt)
        self.slots = Slots(S, cfg.hidden_size, cfg.vocab_size, self.max_len, dev, dt,
                           self.max_len // block_size if block_size else None)
        self.block_table = self.slots.block_table
        self.tts_pad_embed = tts_pad_embed.to(dev, dt)  # [D]
        self.frame_codes = torch.zeros(S, self.K, dtype=torch.long, device=dev)  # output of the last frame
        self.key_pos = torch.arange(self.max_len, device=dev)
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(dev)
        with torch.inference_mode():  # RoPE per cache position [max_len + KV_SPARE, Dh]: a frame looks its rows up
            self.rope_cos, self.rope_sin = (t[0] for t in rope_cos_sin(
                torch.arange(self.max_len + KV_SPARE, device=dev)[None], self.inv_freq, self.dtype))
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # graph_keys() -> the talker's half
        self.code_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # code_graph_keys() -> codes 1..15
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # padded prompt length -> graph
        self.compiled_while_capturing = 0  # graphs Inductor produced during the captures (should be 0)
        self._pool = None  # the graphs' shared memory pool
        # the padded prompt lengths whose single-request prefill is a captured graph (not paged)
        self.prefill_graph_lens = [L for L in PREFILL_GRAPH_LENS if L <= self.max_len] if block_size is None else []
        if self.use_graphs and self.prefill_graph_lens:
            self.alloc_prefill_scratch()
        self.wave_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # wave_keys() -> graph
        # the batched prefill graphs' wave sizes and padded lengths (none in batch-invariant mode: every newcomer's
        # prefill runs alone there)
        self.wave_sizes, self.wave_lens = wave_buckets(S, self.max_len) \
            if self.use_graphs and block_size is None and not invariant.ENABLED else ([], [])
        if self.wave_sizes and self.wave_lens:
            self.alloc_wave_scratch()
        self.compiled = want_compile(dev, compile)  # the vocoder follows the same decision
        # torch's compile cache directory (None: torch's default, or no compile), set before anything compiles
        self.compile_cache = use_compile_cache(compile_cache) if self.compiled else None
        self._sample, self._sample_topk, self._rules = compile_model(talker, self.compiled)
        self.depth = DepthLoop(talker, S, (self._sample, self._sample_topk), self.compiled)

    # ------------------------------------------------------------------ slots
    def move_slot(self, src: int, dst: int) -> None:
        """Compaction: the request in row src continues in row dst (its KV up to its position moves too; paged:
        its block table row moves, and src's points at scratch)."""
        if self.block_table is None:
            n = self.slots.position_cpu[src]
            self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]
        self.slots.move(src, dst)

    def _kv_ctx(self, r: slice, write_pos: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, AttnContext]:
        """The cache the talker gets for rows r (their rows; paged: the pool) and its AttnContext."""
        if self.block_table is None:
            return self.kv[:, :, r], AttnContext(write_pos, mask)
        return self.kv, AttnContext(write_pos, mask, self.block_table[r, : mask.shape[-1] // self.block_size])

    def kv_span(self, length: int) -> int:
        """Cache positions attended for sequences up to `length`: a power of two (one graph per bucket)."""
        return min(self.max_len, alloc_len(length, MIN_KV_SPAN))

    def eager_prefill(self, N: int, L: int) -> bool:
        """A compiled runner prefills N prompts of up to L tokens uncompiled when they take the attention's one-head-
        at-a-time branch (ATTN_SCORES_CHUNK): rare long prompts, whose compilation would slow every cold start."""
        return self.compiled and N * self.cfg.num_attention_heads * L * self.kv_span(L) > ATTN_SCORES_CHUNK

    # ------------------------------------------------------------------ admission
    def prefill_alone_max(self, graphs: bool = True) -> float:
        """The most newcomers of one step that prefill_batch prefills one by one, each as alone (its bucket's prefill
        graph if captured); more take one batched forward. On CUDA (or with prefill graphs) and a contiguous cache
        PREFILL_GRAPH_MAX_REQUESTS (on CUDA in batch-invariant mode any number: inf), else 0. The deadline policy's
        prefill cost model has one regime each side of it (q3tts.engine.deadline.PrefillCost)."""
        cuda = self.device.type == "cuda"  # NOTE(invariant): graphs and eager prefill alike (each prompt alone)
        if cuda and invariant.ENABLED:
            return math.inf
        if (cuda or bool(self.prefill_graphs)) and graphs and self.block_table is None:
            return PREFILL_GRAPH_MAX_REQUESTS
        return 0

    def check_prompt(self, num_positions: int, num_trailing: int) -> None:
        """InputError unless a prompt of num_positions (+ num_trailing streamed text tokens) fits the cache (checked
        per request before the batched prefill, so one bad request does not fail the others)."""
        if num_positions >= self.max_len or num_trailing > self.max_len:
            raise InputError(f"prompt too long: {num_positions} positions (+{num_trailing} streamed text tokens) "
                             f"for the engine's max_seq_len {self.max_len}; shorten the text", param="text",
                             code="input_too_long")

    @torch.inference_mode()
    def admit(self, lo: int, prepared: list[PreparedRequest]) -> torch.Tensor:
        """Embed the prompts of N prepared requests (laid out, checked by check_prompt) and prefill them into rows
        [lo, lo+N) -> their code 0 of frame 0 [N], on the device: no host sync (the caller reads it once its own host
        work is done). The wave is embedded in one pass (embed_prompts) and its slots written per field (Slots.admit):
        a host->device copy each, none per row, whatever N."""
        lens = [len(p.layout) for p in prepared]
        alone, buckets, L = self._prefill_shape(lens)
        x, trailing = embed_prompts(self.talker, [p.layout for p in prepared], [p.speaker_embedding for p in prepared],
                                    [p.ref_codes for p in prepared], L)  # straight into the padded batch
        return self.prefill_padded(lo, x.to(self.dtype), lens, alone, buckets, trailing,
                                   [len(p.layout.trailing_ids) for p in prepared], [p.params for p in prepared])

    @torch.inference_mode()
    def append_text(self, feeds: list[tuple[int, int, list[int]]]) -> None:
        """Streamed text: per (slot, start, ids) the row's next text token ids, embedded at trailing[start:]. Every
        row's tokens of the step in one staged copy (with their places and the rows' new lengths; the text rows
        themselves where the table lives in host memory), one text projection and one scatter: no host sync, a few
        launches whatever the rows."""
        feeds = [(slot, start, ids) for slot, start, ids in feeds if ids]
        if not feeds:
            return
        assert all(start + len(ids) <= self.max_len for _, start, ids in feeds), "the engine checks the room"
        ids = torch.tensor([i for *_, row_ids in feeds for i in row_ids])  # [M]
        M, F = ids.shape[0], len(feeds)
        index = torch.tensor([slot for slot, _, row_ids in feeds for _ in row_ids]  # [2M + 2F]: row, position, ...
                             + [start + j for _, start, row_ids in feeds for j in range(len(row_ids))]
                             + [slot for slot, *_ in feeds] + [start + len(row_ids) for _, start, row_ids in feeds])
        text, index = to_device([self.talker.staged_text(ids), index], self.device)
        row, col, slot, length = index.split([M, M, F, F])
        # NOTE(invariant): one projection for every row's tokens (as embed_prompts for a wave): in batch-invariant
        # mode a token's bits are those of its own row's call (TextProjection)
        text = self.talker.project_staged_text(text)  # [M, D]
        self.slots.trailing[row, col] = text.to(self.dtype)
        self.slots.trailing_len[slot] = length

    @torch.inference_mode()
    def prefill_batch(self, lo: int, prefills: list[torch.Tensor], trailings: list[torch.Tensor],
                      params: list[SamplingParams], graphs: bool = True) -> list[int]:
        """Admit N requests into rows [lo, lo+N); returns their code 0 of frame 0.
        prefills: N x [L_i, D] prompt embeddings, trailings: N x [S_i, D]; each passed check_prompt.
        On CUDA up to PREFILL_GRAPH_MAX_REQUESTS prompts (contiguous cache; any number in batch-invariant mode) are
        prefilled one by one, each as alone (its bucket's prefill graph if captured); more by wave graphs where
        captured (_replay_wave), else (and with graphs=False, the warm-up of the compiled variants) in one batched
        forward."""
        N, D = len(prefills), self.cfg.hidden_size
        lens = [p.shape[0] for p in prefills]
        alone, buckets, L = self._prefill_shape(lens, graphs)
        x = torch.zeros(N, L, D, device=self.device, dtype=self.dtype)  # right-padded with zeros
        for i, pre in enumerate(prefills):
            x[i, : lens[i]] = pre.to(self.dtype)
        trailing = torch.cat([t.to(self.device) for t in trailings]) if N else x.new_zeros(0, D)
        return self.prefill_padded(lo, x, lens, alone, buckets, trailing, [t.shape[0] for t in trailings],
                                   params, graphs).tolist()

    def _prefill_shape(self, lens: list[int], graphs: bool = True) -> tuple[bool, list[int], int]:
        """For prompts of these lengths -> (prefilled one by one as alone, each one's padded length, the batch's
        padded length L)."""
        N = len(lens)
        alone = N <= self.prefill_alone_max(graphs)
        buckets = [self.prefill_len(1, n) for n in lens] if alone else [self.prefill_len(N, max(lens))] * N
        return alone, buckets, max(buckets)

    def prefill_padded(self, lo: int, x: torch.Tensor, lens: list[int], alone: bool, buckets: list[int],
                       trailing: torch.Tensor, trailing_lens: list[int], params: list[SamplingParams],
                       graphs: bool = True) -> torch.Tensor:
        """prefill_batch on the wave's padded prompts x [N, L, D] (lens: the real lengths; alone, buckets: from
        _prefill_shape) and its trailing text packed [sum S_i, D] (row i's trailing_lens[i] rows in order) -> their
        code 0 of frame 0 [N] on the device (rows [lo, lo+N) of last_code0: read it before the next frame).
        graphs False: no wave graph either (the warm-up of the batched forward's compiled variants)."""
        N, s = len(lens), self.slots
        r = slice(lo, lo + N)
        assert max(lens, default=0) < self.max_len and max(trailing_lens, default=0) <= self.max_len, "check_prompt"
        last = s.admit(lo, params, lens, trailing, trailing_lens)  # [N] the prompts' lengths, on the device
        if alone:  # NOTE(alone): each newcomer's prefill and code 0 exactly as when it comes alone, row by row
            for i, b in enumerate(buckets):
                graph = self.prefill_graphs.get(b)
                if graph is not None:  # its bucket's captured prefill (scratch cache) and code 0; the cache row copied
                    self.prefill_in[:, :b] = x[i, :b]
                    self.prefill_last.fill_(lens[i] - 1)
                    self.prefill_row.fill_(lo + i)
                    graph.replay()
                    self.kv[:, :, lo + i, :, :b] = self.prefill_kv[:, :, 0, :, :b]
                else:
                    table = None if self.block_table is None else self.block_table[lo + i:lo + i + 1]
                    kv = self.kv if table is not None else self.kv[:, :, lo + i:lo + i + 1]
                    h = self._prefill_forward(x[i:i + 1, :b], kv, table, last[i:i + 1] - 1)
                    self._first_code0(h, torch.full((1,), lo + i, device=self.device))
        else:  # chunks of up to the largest wave size: each its wave graph where one fits, else one batched forward
            step = (max(self.wave_sizes, default=N) if graphs else N) or 1
            for c in range(0, N, step):
                n = min(step, N - c)
                if not (graphs and self._replay_wave(lo + c, x[c:c + n], last[c:c + n])):
                    self._prefill_rows(lo + c, x[c:c + n], last[c:c + n])
        return s.last_code0[r]

    def _prefill_rows(self, lo: int, x: torch.Tensor, last: torch.Tensor) -> None:
        """One batched forward launched from Python: prompts x [N, L, D] (lengths last [N], on the device) into rows
        [lo, lo+N), and their code 0 of frame 0."""
        N, r = x.shape[0], slice(lo, lo + x.shape[0])
        kv = self.kv if self.block_table is not None else self.kv[:, :, r]
        table = None if self.block_table is None else self.block_table[r]
        h = self._prefill_forward(x, kv, table, last - 1)
        self.slots.last_hidden[r] = h
        self._sample_code0(lo, lo + N, h, capped=False)

    def _replay_wave(self, lo: int, x: torch.Tensor, last: torch.Tensor) -> bool:
        """Prompts x [n, L, D] (lengths last [n]) into rows [lo, lo+n) by the least wave graph (N, Lb) that holds
        them, if any: its N - n padding rows are the free rows behind them (their writes, into free rows' state, are
        rewritten when a request takes the row), so [lo, lo+N) must lie inside the slots. False: none fits."""
        n, L = x.shape[:2]
        N = next((b for b in self.wave_sizes if b >= n), None)
        Lb = next((b for b in self.wave_lens if b >= L), None)
        graph = self.wave_graphs.get((N, Lb))
        if graph is None or lo + N > self.num_rows:
            return False
        # rows [n, N) and positions [L, Lb) keep an earlier wave's finite values: NOTE(C1), never read
        self.wave_input(N, Lb)[:n, :L] = x
        self.wave_last[:n] = last - 1
        self.wave_last[n:N] = 0
        self.wave_rows[:N] = self.row_ids[lo:lo + N]
        graph.replay()
        self.kv[:, :, lo:lo + n, :, :L] = self.wave_kv[:, :, :n, :, :L]
        return True

    def prefill_len(self, N: int, L: int) -> int:
        """The padded length a prefill of N prompts of up to L tokens runs at: on CUDA one prompt of up to
        PREFILL_GRAPH_LENS[-1] tokens pads to its bucket (the shape of its captured graph; eager CUDA runs pad
        alike so both compute the same GEMM shapes), else L. CPU runs never pad (exact parity)."""
        if N == 1 and self.device.type == "cuda" and self.block_table is None:
            return next((b for b in PREFILL_GRAPH_LENS if L <= b <= self.max_len), L)
        return L

    def _prefill_forward(self, x: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor | None,
                         last: torch.Tensor) -> torch.Tensor:
        """x [N, L, D] right-padded prompts -> each row's final hidden at index last [N] ([N, D]); writes their K/V
        into kv (this batch's rows, or paged: the pool with the rows' block_table).
        NOTE(C1): positions 0..L-1 in every row, so row i's tokens 0..L_i-1 sit exactly where they would alone and
        a plain causal mask is right: a real query p < L_i attends keys <= p, all real. The padding behind them
        writes junk (finite) K/V at L_i..L-1, never read: the decode writes position L_i before it attends to it (it
        writes p, then attends <= p), and masks the rest (probability 0; 0 * finite = 0)."""
        N, L = x.shape[:2]
        pos = torch.arange(L, device=self.device)[None].expand(N, -1)  # [N, L]
        n = self.kv_span(L)
        mask = (self.key_pos[None, :n] <= pos[0][:, None])[None, None]  # [1, 1, L, n]
        ctx = AttnContext(pos, mask, None if block_table is None else block_table[:, : n // self.block_size])
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        with torch.compiler.set_stance("force_eager") if self.eager_prefill(N, L) else contextlib.nullcontext():
            out = self.talker(x, cos, sin, kv, ctx)  # [N, L, D]
        return out[torch.arange(N, device=self.device), last]

    # ------------------------------------------------------------------ the frame
    def _draw_code0(self, h: torch.Tensor, rows: slice | torch.Tensor, capped: bool) -> torch.Tensor:
        """h [B, D] final talker hidden of rows (a slice, or their indices [B] on the device) -> their code 0 [B]: the
        rules on the rows' history, then the sampler on their noise. Reads the slots, writes nothing."""
        t, s = self.cfg, self.slots
        p = s.sampling.rows(rows)
        generated = s.num_generated[rows]
        logits = linear(h, self.talker.codec_head.weight).float()
        logits = self._rules(logits, s.seen[rows], p.repetition_penalty, generated, t.codec_eos_token_id,
                             t.vocab_size - 1024)
        noise = uniform_noise(s.seed[rows], generated, 0, logits.shape[-1])
        return self.depth.draw(capped, s.topk_ok[rows], logits, p.do_sample, p.temperature, p.top_k, p.top_p, noise)

    def _first_code0(self, h: torch.Tensor, row: torch.Tensor) -> None:
        """Newcomers' prefill results: h [N, D] their prompts' last hidden, row [N] their rows on the device (distinct)
        -> their code 0 of frame 0, history and counters, written by index (no host value: a prefill graph captures
        it with its rows as an input). The uncapped sampler, as for any newcomer (its parameters are not checked on
        the host)."""
        s = self.slots
        code0 = self._draw_code0(h, row, capped=False)
        s.last_hidden.index_copy_(0, row, h)
        s.seen.index_copy_(0, row, s.seen[row].scatter_(1, code0[:, None], True))
        s.num_generated.index_copy_(0, row, s.num_generated[row] + 1)
        s.last_code0.index_copy_(0, row, code0)

    def _sample_code0(self, lo: int, hi: int, h: torch.Tensor, capped: bool, act: torch.Tensor | None = None) -> None:
        """h: [B, D] final talker hidden of rows [lo, hi) -> last_code0; updates history and counters
        (act [B] bool: only of those rows)."""
        s, r = self.slots, slice(lo, hi)
        code0 = self._draw_code0(h, r, capped)
        if act is None:
            s.seen[r].scatter_(1, code0[:, None], True)
            s.num_generated[r] += 1
            s.last_code0[r] = code0
        else:
            s.seen[r].scatter_(1, code0[:, None], act[:, None] | s.seen[r].gather(1, code0[:, None]))
            s.num_generated[r] += act
            s.last_code0[r] = torch.where(act, code0, s.last_code0[r])

    def _frame(self, B: int, n: int, capped: bool = False) -> None:
        """One whole frame for rows [0, B), attending over n cache positions. Static shapes, no host sync.
        capped: every row's top_k fits TOPK_CAP, so the cheaper top-k sampler draws the same tokens."""
        self._frame_codes(B, capped)
        self._frame_talker(B, n, capped)

    def _frame_codes(self, B: int, capped: bool = False) -> None:
        """Codes 1..15 of the current frame (code predictor) -> frame_codes[:B]."""
        s, r = self.slots, slice(0, B)
        code0 = s.last_code0[r]
        frame = s.num_generated[r] - 1  # this frame's index: noise differs per frame and codebook
        codes = self.depth(s.last_hidden[r], code0, s.sampling.rows(r), s.seed[r], frame, capped, s.topk_ok[r])
        self.frame_codes[r] = torch.cat([code0[:, None], codes], dim=1)

    def _frame_talker(self, B: int, n: int, capped: bool = False) -> None:
        """Talker step on the completed frame -> next hidden and code 0."""
        s, r = self.slots, slice(0, B)
        frame_idx = s.num_generated[r] - 1  # frames completed before this one
        x = self.talker.embed_codes(self.frame_codes[r])
        use_text = frame_idx < s.trailing_len[r]
        text = s.trailing[torch.arange(B, device=self.device), frame_idx.clamp(0, self.max_len - 1)]
        x = x + torch.where(use_text[:, None], text, self.tts_pad_embed[None])
        pos = s.position[r][:, None]  # [B, 1]
        kv, ctx = self._kv_ctx(r, pos, self.key_pos[None, None, None, :n] <= pos[:, None, :, None])
        h = self.talker(x[:, None], self.rope_cos[pos], self.rope_sin[pos], kv, ctx)[:, -1]
        act = s.active[r]  # NOTE(sit-out): a row that sits out writes K/V at its position, rewritten when it runs
        s.position[r] += act
        s.last_hidden[r] = torch.where(act[:, None], h, s.last_hidden[r])
        self._sample_code0(0, B, h, capped, act)

    @torch.inference_mode()
    def decode_frame(self, B: int, active: list[bool]) -> FrameResult:
        """One whole frame for the running rows [0, B); a row with active[row] False sits it out."""
        s = self.slots
        s.set_active(B, active)
        n = self.kv_span(max(s.position_cpu[:B]) + 1)
        capped = all(s.topk_ok_cpu[:B])
        if self.use_graphs:
            Bp = next(b for b in self.batch_buckets if b >= B)
            graphs = self.frame_graphs(Bp, n, capped)
            if Bp > B:
                s.position[B:Bp] = 0  # padding rows are free slots: position 0 keeps their writes in the cache
                if self.block_table is not None:
                    self.block_table[B:Bp] = 0  # paged: in the scratch block (a free slot's blocks may be others' now)
            for graph in graphs:
                graph.replay()
        else:
            self._frame(B, n, capped)
        s.position_cpu[:B] = [p + a for p, a in zip(s.position_cpu[:B], active)]
        # on the device for the vocoder (a copy: the buffer is reused); unbound once here, as each row takes its own
        codes = self.frame_codes[:B].clone().unbind(0)
        with device_wait():
            code0 = s.last_code0[:B].tolist()  # the one sync per frame
        return FrameResult(codes, code0)

    # ------------------------------------------------------------------ CUDA graphs
    def graph_keys(self) -> list[tuple[int, int, bool]]:
        """(batch bucket, length bucket, capped sampler): one CUDA graph each of a frame's talker half."""
        lens = [MIN_KV_SPAN << i for i in range(self.max_len.bit_length()) if MIN_KV_SPAN << i <= self.max_len]
        return [(B, n, c) for B in self.batch_buckets for n in lens for c in (True, False)]

    def frame_graphs(self, B: int, n: int, capped: bool) -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]:
        """A frame's two captured halves for batch bucket B, span n and the sampler, in replay order."""
        codes, talker = self.code_graphs.get((B, capped)), self.graphs.get((B, n, capped))
        if codes is None or talker is None:
            raise RuntimeError(f"no CUDA graph for batch {B} x length {n}: call capture_graphs() before serving")
        return codes, talker

    @property
    def num_frame_graphs(self) -> int:
        """The frames' CUDA graphs captured: talker halves + code-predictor halves."""
        return len(self.graphs) + len(self.code_graphs)

    def code_graph_keys(self) -> list[tuple[int, bool]]:
        """(batch bucket, capped sampler): one CUDA graph each of a frame's code-predictor half."""
        return [(B, c) for B in self.batch_buckets for c in (True, False)]

    def alloc_prefill_scratch(self) -> None:
        """The prefill graphs' static inputs (the padded prompt, its last index, the newcomer's row) and a scratch
        cache of one row that they write, copied into the admitted row afterwards. The inputs inference tensors and
        the cache not, as an eager prefill's: the compiled layers guard on their inputs' dispatch keys (more
        compilations at start-up otherwise)."""
        cfg, D, dev, dt = self.cfg, self.cfg.hidden_size, self.device, self.dtype
        Lp = max(b for b in PREFILL_GRAPH_LENS if b <= self.max_len)
        with torch.inference_mode():
            self.prefill_in = torch.zeros(1, Lp, D, device=dev, dtype=dt)
            self.prefill_last = torch.zeros(1, dtype=torch.long, device=dev)
            self.prefill_row = torch.zeros(1, dtype=torch.long, device=dev)
        self.prefill_kv = torch.zeros(cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, Lp + KV_SPARE,
                                      cfg.head_dim, device=dev, dtype=dt)

    def wave_keys(self) -> list[tuple[int, int]]:
        """(wave size, padded length): one batched prefill graph each."""
        return [(N, L) for N in self.wave_sizes for L in self.wave_lens]

    def alloc_wave_scratch(self) -> None:
        """The wave graphs' static inputs (the padded prompts, their last indices, their rows) and the scratch cache
        of the largest wave that they write, copied into the admitted rows afterwards (as alloc_prefill_scratch's;
        memory.wave_scratch_bytes counts it in the engine's workspace)."""
        cfg, D, dev, dt = self.cfg, self.cfg.hidden_size, self.device, self.dtype
        N, L = max(self.wave_sizes), max(self.wave_lens)
        with torch.inference_mode():
            self.wave_in = torch.zeros(N * L, D, device=dev, dtype=dt)  # flat: see wave_input
            self.wave_last = torch.zeros(N, dtype=torch.long, device=dev)
            self.row_ids = torch.arange(self.num_rows, device=dev)
            self.wave_rows = self.row_ids[:N].clone()  # distinct rows for the warm-ups too
        self.wave_kv = torch.zeros(cfg.num_hidden_layers, 2, N, cfg.num_key_value_heads, L + KV_SPARE, cfg.head_dim,
                                   device=dev, dtype=dt)

    def wave_input(self, N: int, L: int) -> torch.Tensor:
        """The static input of wave graph (N, L): a contiguous [N, L, D] view of the front of wave_in. NOTE(compile):
        contiguous for every key, so the first decoder layer takes the same compiled variant as the others (a slice
        [:N, :L] of an [N_max, L_max, D] buffer is strided and compiles a variant of its own, whose Dynamo symbols can
        differ between a helper's process and the engine's: a compile-cache miss, compile_helpers)."""
        return self.wave_in[:N * L].view(N, L, self.cfg.hidden_size)

    def _prefill_wave(self, N: int, L: int) -> None:
        """A wave of N newcomers at padded length L (a wave graph): their prompts from the static input into the
        scratch cache, then their code 0 of frame 0 into their rows (wave_rows; _first_code0)."""
        h = self._prefill_forward(self.wave_input(N, L), self.wave_kv[:, :, :N], None, self.wave_last[:N])
        self._first_code0(h, self.wave_rows[:N])

    def _prefill_one(self, L: int) -> None:
        """One newcomer's admission at padded length L (a prefill graph): its prompt from the static input into the
        scratch cache, then its code 0 of frame 0 into its row (prefill_row; _first_code0)."""
        h = self._prefill_forward(self.prefill_in[:, :L], self.prefill_kv, None, self.prefill_last)
        self._first_code0(h, self.prefill_row)

    def warm_up_frames(self, keys, half: str = "") -> None:
        """One frame per key before capturing (compilation, allocations, cuBLAS handles), each from position 0: past
        the key's span n a paged row would write outside its n // block_size blocks (a device-side assert). half:
        one of compile_helpers.HALVES runs that half of each frame alone (a compile helper's unit: halves())."""
        codes, talker = HALVES
        for B, n, capped in keys:
            self.slots.position.zero_()
            if half != talker:
                self._frame_codes(B, capped)
            if half != codes:
                self._frame_talker(B, n, capped)

    def capture_graphs(self, source: Source | None = None) -> int:
        """One CUDA graph per graph_keys(), code_graph_keys() and prefill length (q3tts.engine.graphs.capture_runner);
        must run while no request is active. Returns the number of the frames' graphs. source: the checkpoint's, for
        compile helpers on a cold start (q3tts.engine.compile_helpers)."""
        return capture_runner(self, source) if self.use_graphs else 0
