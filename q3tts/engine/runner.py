"""Everything that runs on the device: static caches, batched prefill, and the whole-frame decode step.

Slots are rows of the persistent batch; the running requests always occupy rows [0, B) (the engine
compacts on finish with `move_slot`), so a frame reads and writes plain views of the caches: no
gather, no copy; a step's newcomers take the next rows [B, B+N) and are prefilled in one forward.
Each slot keeps its state in preallocated tensors (position, last talker hidden, last code 0, code-0
history, sampling parameters, seed, trailing text).

One frame (`_frame(B, n)`) for rows [0, B), attending over the first n cache positions:
  1. code predictor: fresh 2-token prefill [h, codec_embedding(code0)] -> code 1, then 14 steps -> codes 2..15
  2. talker input = embed_codes(frame) + trailing_text[frame] (tts_pad once the text is used up)
  3. talker step at each row's position -> hidden h' -> codec_head -> rules -> sample next code 0
A row whose text is streamed in and whose next token has not arrived sits the frame out (`active` False):
it is computed with the others but its state is left as it was, so it runs the same frame later.
It has fixed shapes for fixed (B, n), reads no host value, and syncs nothing, so on CUDA it is
captured once per (batch bucket, length bucket) as one CUDA graph and replayed with padding rows.
One request's prefill is captured too, per padded prompt length (PREFILL_GRAPH_LENS), into a scratch cache row that
is then copied into the request's row: it is most of the time to first audio when launched from Python.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os

import torch
import torch.nn.functional as F

from .. import invariant
from ..inputs.request import InputError
from ..kernels import MAX_ROWS, gemv_ex, gemv_ex_applies, linear
from ..models.layers import ATTN_SCORES_CHUNK, AttnContext, DecoderLayer, rope_cos_sin, rope_inv_freq
from ..models.talker import Talker
from ..sampling import TOPK_CAP, SamplingParams, frame_noise, sample, sample_topk, talker_logits_rules, uniform_noise
from .compile_cache import compile_counts, use_compile_cache
from .memory import KV_SPARE, alloc_len
from .scheduler import FrameResult

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MIN_KV_SPAN = 64
FUSED_CP_MAX_BATCH = 1  # the code-predictor step compiled whole: measured faster for one stream on an H200
# One request's prefill runs as a captured graph for prompts up to these lengths (padded to the next): launched from
# Python, the 28 compiled layers' ~450 kernels took 13.6 ms for a 43-token prompt on an H100, most of the time to
# first audio (25.7 ms); a graph launches them at once
PREFILL_GRAPH_LENS = (16, 32, 64, 128, 256)
# Up to this many requests admitted in one step replay their prefill graphs one after another rather than run one
# batched forward launched from Python. From the seventh session's H100 figures: a replay took ~1.8 ms for a
# 43-token prompt (first audio 25.9 -> 14.1 ms when it replaced a 13.6 ms launch), while the batched forward is
# launch-bound: 13.4 ms for 16 such prompts. Four replays (~7 ms) stay well under one batched forward; from about
# seven on they would not. Not timed as such yet.
PREFILL_GRAPH_MAX_REQUESTS = 4
log = logging.getLogger("q3tts.engine")


def compile_layers(talker: Talker) -> None:
    """torch.compile each decoder layer's forward (fuses norms, RoPE and the attention glue into a few
    kernels: measured 1.7x faster frames on an H200). One compiled function serves every layer instance;
    batch and length are dynamic, so a handful of compilations cover all graph buckets."""
    import torch._dynamo
    import torch._inductor.config
    import torch.fx.experimental._config as fx_config
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # NOTE: no duck shaping: by default two sizes that happen to be equal at compile time share one symbol, so a
    # prefill whose attention span (64) equalled the head dim (64) was compiled for that span only, and every
    # request with a longer prompt recompiled (seconds, while every stream waits)
    fx_config.use_duck_shape = False
    # NOTE: float attributes (the norms' eps) as constants: with dynamic=True Dynamo first makes them symbolic
    # floats, then finds Inductor cannot keep them so and restarts the whole trace (measured: 7 of 10 s of the
    # layer's tracing in a process whose compile cache is warm, and a wasted AOTAutograd cache lookup)
    torch._dynamo.config.specialize_float = True
    # NOTE: no matmul padding: Inductor's pad_mm pass guards the attended span (3 <= n <= 127), so the 128- and
    # 256-position spans each compiled every layer variant again (measured: 6 of a start-up's 60 compilations); the
    # dims it would pad are multiples of 64 already
    torch._inductor.config.shape_padding = False
    # NOTE: Inductor's own kernels do not take part in programmatic dependent launch (triton.enable_pdl), only the
    # engine's (q3tts.kernels: they load weights early and wait for the kernel before them before touching anything
    # else). Measured on an H100:
    # - With Inductor's PDL only in the code predictor's step compiled whole, bf16 graph and eager codes parted at the
    #   second frame (with it nowhere, or everywhere as in the seventh session, they are identical). The likely race:
    #   an Inductor kernel waits only for buffers the previous node of its graph wrote, while ours let the next
    #   kernel start before they wait themselves.
    # - Inductor cannot launch a PDL kernel with its static launcher, so a restart loads such kernels through
    #   Triton's: with PDL in every compiled graph a warm start took 81.9 s instead of 57.6.
    # - The gain was within the machines' spread: the frame graph took 3.45 ms with Inductor's kernels in PDL, 3.44
    #   with them in the code predictor's step only, 3.53 with none (the same code measures 3.39-3.81 ms).
    fwd = torch.compile(DecoderLayer.forward, dynamic=True, fullgraph=True)
    for m in talker.modules():
        if isinstance(m, DecoderLayer) and not isinstance(m.forward, functools.partial):
            m.forward = functools.partial(fwd, m)


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector paused for a loop of CUDA-graph captures, after one collection.
    - Paused: a collection during a capture can free an engine dropped earlier, whose graphs then reset mid-capture
      and invalidate it (seen in the GPU tests, which build engine after engine in one process).
    - Once per loop, not per capture: with Dynamo and Inductor loaded a collection takes 0.2-0.5 s, and a start-up
      captures ~100 graphs (the ~60 s of a cold start that no warm-up frame or compilation accounted for)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def want_compile(device: torch.device, flag: bool | None) -> bool:
    """Default: on for CUDA (set Q3TTS_COMPILE=0 to disable), off on CPU."""
    if flag is not None:
        return flag
    env = os.environ.get("Q3TTS_COMPILE")
    return env == "1" if env is not None else device.type == "cuda"


class ModelRunner:
    def __init__(self, talker: Talker, tts_pad_embed: torch.Tensor, max_slots: int, max_len: int,
                 use_cuda_graphs: bool | None = None, compile: bool | None = None, block_size: int | None = None,
                 num_blocks: int | None = None, compile_cache: str | bool | None = None):
        cfg = talker.cfg
        cp = cfg.code_predictor
        p = next(talker.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.talker, self.cfg = talker, cfg
        self.K = cfg.num_code_groups
        self.max_len = alloc_len(max_len, MIN_KV_SPAN)  # a power of two: the last length bucket
        self.use_graphs = (self.device.type == "cuda") if use_cuda_graphs is None else use_cuda_graphs
        # graph batch buckets: the powers of two below max_slots, then max_slots itself, so a padded replay never
        # touches a row past the slots (no KV rows allocated for padding alone)
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_slots) + (max_slots,)
        S = self.num_rows = max_slots
        dev, dt = self.device, self.dtype
        V, D = cfg.vocab_size, cfg.hidden_size
        # KV caches: [layers, k/v, slots, kv heads, positions, head_dim]; paged (block_size): a pool of blocks
        # [layers, k/v, blocks, kv heads, block_size, head_dim] and each slot's block table [S, max_len / block_size]
        # (block 0 is scratch: the entries of positions a row has no block for, and the rows of free slots)
        self.block_size = block_size
        if block_size:
            assert MIN_KV_SPAN % block_size == 0, "every attended span must be whole blocks"
            self.num_blocks = num_blocks or S * (self.max_len // block_size) + 1
            self.kv = torch.zeros(cfg.num_hidden_layers, 2, self.num_blocks, cfg.num_key_value_heads, block_size,
                                  cfg.head_dim, device=dev, dtype=dt)
            self.block_table = torch.zeros(S, self.max_len // block_size, dtype=torch.long, device=dev)
        else:
            self.kv = torch.zeros(cfg.num_hidden_layers, 2, S, cfg.num_key_value_heads, self.max_len + KV_SPARE,
                                  cfg.head_dim, device=dev, dtype=dt)
            self.block_table = None
        # (KV_SPARE as in the talker's cache: the steps attend all K positions, never a slice to the end)
        self.cp_kv = torch.zeros(cp.num_hidden_layers, 2, S, cp.num_key_value_heads, self.K + KV_SPARE, cp.head_dim,
                                 device=dev, dtype=dt)
        self.tts_pad_embed = tts_pad_embed.to(dev, dt)  # [D]
        # per-slot state
        self.position = torch.zeros(S, dtype=torch.long, device=dev)  # next cache position
        self.position_cpu = [0] * S  # host mirror: picks the length bucket without a device sync
        self.num_generated = torch.zeros(S, dtype=torch.long, device=dev)  # code-0 tokens sampled so far
        self.last_hidden = torch.zeros(S, D, device=dev, dtype=dt)
        self.last_code0 = torch.zeros(S, dtype=torch.long, device=dev)
        self.seen = torch.zeros(S, V, dtype=torch.bool, device=dev)  # code-0 history for the penalty
        self.trailing = torch.zeros(S, self.max_len, D, device=dev, dtype=dt)
        self.trailing_len = torch.zeros(S, dtype=torch.long, device=dev)
        self.seed = torch.zeros(S, dtype=torch.long, device=dev)
        self.params = {n: torch.ones(S, dtype=torch.float32, device=dev) for n in (
            "temperature", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_p")}
        self.params.update({n: torch.zeros(S, dtype=torch.long, device=dev) for n in ("top_k", "subtalker_top_k")})
        self.params.update({n: torch.zeros(S, dtype=torch.bool, device=dev) for n in ("do_sample", "subtalker_dosample")})
        self.frame_codes = torch.zeros(S, self.K, dtype=torch.long, device=dev)  # output of the last frame
        self.active = torch.ones(S, dtype=torch.bool, device=dev)  # rows whose frame counts (see module doc)
        self.active_cpu = [True] * S
        self.key_pos = torch.arange(self.max_len, device=dev)
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(dev)
        self.cp_inv_freq = rope_inv_freq(cp.head_dim, cp.rope_theta).to(dev)
        self.cp_steps = [self._cp_step_inputs(i) for i in range(self.K - 1)]  # (cos, sin, write_pos, mask) per step
        with torch.inference_mode():  # the talker's RoPE per cache position [max_len + KV_SPARE, Dh]: a frame looks its
            # rows up (two launches instead of rope_cos_sin's seven; the same elementwise values)
            self.rope_cos, self.rope_sin = (t[0] for t in rope_cos_sin(
                torch.arange(self.max_len + KV_SPARE, device=dev)[None], self.inv_freq, self.dtype))
        # the capped sampler (topk instead of full sorts) serves rows whose top_k fits TOPK_CAP
        self.topk_ok_cpu = [True] * S
        self.topk_ok = torch.ones(S, dtype=torch.bool, device=dev)  # on the device (batch-invariant mode: _draw)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # padded prompt length -> graph (capture_graphs)
        self.compiled_while_capturing = 0  # graphs Inductor produced during capture_graphs' captures (should be 0)
        if self.use_graphs and block_size is None:
            self.alloc_prefill_scratch()
        self._pool = None
        self._sample, self._sample_topk, self._rules = sample, sample_topk, talker_logits_rules
        self._cp_step_fused = None
        self.compiled = want_compile(self.device, compile)  # the vocoder follows the same decision
        self.compile_cache = None  # the directory of torch's compile caches (None: torch's default, or no compile)
        if self.compiled:
            self.compile_cache = use_compile_cache(compile_cache)  # before the first compilation (they are lazy)
            compile_layers(talker)
            self._sample, self._sample_topk, self._rules = (
                torch.compile(f, dynamic=True) for f in (sample, sample_topk, talker_logits_rules))
            if invariant.ENABLED:  # NOTE(invariant): eager torch reduces each row alone (sorts, softmax, cumsum);
                self._sample = sample  # Inductor compiles 1 row and n rows apart, and may reduce them differently
            # static shapes: 2 step shapes x 2 samplers per batch size up to FUSED_CP_MAX_BATCH
            self._cp_step_fused = torch.compile(self._cp_step, dynamic=False, fullgraph=True)
            # The step compiled whole has a cache of its own: per layer a k and a v tensor that alias nothing, which its
            # attention kernel writes in place (AttnContext.write_kv_in_attention). (The batched steps keep views of
            # cp_kv: the compiled layer they share with the talker guards on how its inputs alias, and non-aliasing
            # caches compiled it once more.) Under 1 MB, inside memory.NON_TORCH_RESERVE's margin.
            self.cp_kv_whole = [tuple(torch.zeros(min(S, FUSED_CP_MAX_BATCH), cp.num_key_value_heads,
                                                  self.K + KV_SPARE, cp.head_dim, device=dev, dtype=dt)
                                      for _ in range(2)) for _ in range(cp.num_hidden_layers)]

    # ------------------------------------------------------------------ slots
    def _state_tensors(self):
        paged = [] if self.block_table is None else [self.block_table]
        return [self.position, self.num_generated, self.last_hidden, self.last_code0, self.seen, self.trailing,
                self.trailing_len, self.seed, self.topk_ok, *self.params.values(), *paged]

    def move_slot(self, src: int, dst: int) -> None:
        """Compaction: the request in row src continues in row dst (its KV up to its position moves too; paged:
        its block table row moves, and src's points at scratch)."""
        n = self.position_cpu[src]
        if self.block_table is None:
            self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]
        for t in self._state_tensors():
            t[dst] = t[src]
        if self.block_table is not None:
            self.block_table[src] = 0
        self.position_cpu[dst] = n
        self.topk_ok_cpu[dst] = self.topk_ok_cpu[src]

    def set_blocks(self, rows: list[tuple[int, list[int]]]) -> None:
        """Paged: (slot, its blocks in position order) -> the slots' block table rows (the rest -> scratch)."""
        if not rows:
            return
        W = self.block_table.shape[1]
        table = torch.tensor([blocks + [0] * (W - len(blocks)) for _, blocks in rows])
        self.block_table[torch.tensor([s for s, _ in rows], device=self.device)] = table.to(self.device)

    def _kv_ctx(self, r: slice, write_pos: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, AttnContext]:
        """The cache the talker gets for rows r (their rows; paged: the pool) and its AttnContext."""
        if self.block_table is None:
            return self.kv[:, :, r], AttnContext(write_pos, mask)
        return self.kv, AttnContext(write_pos, mask, self.block_table[r, : mask.shape[-1] // self.block_size])

    def kv_span(self, length: int) -> int:
        """Cache positions attended for sequences up to `length`: a power of two (one graph per bucket)."""
        return min(self.max_len, alloc_len(length, MIN_KV_SPAN))

    def eager_prefill(self, N: int, L: int) -> bool:
        """A compiled runner prefills N prompts of up to L tokens uncompiled when they take the attention's
        one-head-at-a-time branch (ATTN_SCORES_CHUNK): prompts of a thousand tokens and more, rare, whose GEMMs
        dominate; compiling that branch cost a cold start 14-20 s per variant (measured on an H200), warmed up for
        requests that may never come."""
        return self.compiled and N * self.cfg.num_attention_heads * L * self.kv_span(L) > ATTN_SCORES_CHUNK

    # ------------------------------------------------------------------ admission
    def check_prompt(self, num_positions: int, num_trailing: int) -> None:
        """ValueError unless a prompt of num_positions (+ num_trailing streamed text tokens) fits the cache.
        Checked per request before the batched prefill, so one bad request does not fail the others."""
        if num_positions >= self.max_len or num_trailing > self.max_len:
            raise InputError(f"prompt too long: {num_positions} positions (+{num_trailing} streamed text tokens) "
                             f"for the engine's max_seq_len {self.max_len}; shorten the text", param="text",
                             code="input_too_long")

    @torch.inference_mode()
    def prefill_batch(self, lo: int, prefills: list[torch.Tensor], trailings: list[torch.Tensor],
                      params: list[SamplingParams], graphs: bool = True) -> list[int]:
        """Admit N requests into rows [lo, lo+N); returns their code 0 of frame 0.
        prefills: N x [L_i, D] prompt embeddings, trailings: N x [S_i, D]; each passed check_prompt.
        On CUDA up to PREFILL_GRAPH_MAX_REQUESTS prompts (contiguous cache), any number in batch-invariant mode, are
        prefilled one after another, each exactly as alone (its bucket's captured prefill graph where there is one);
        else one talker forward prefills them all (graphs=False: always, outside batch-invariant mode, for the
        warm-up of its compiled variants)."""
        N, D = len(prefills), self.cfg.hidden_size
        lens = [p.shape[0] for p in prefills]
        # NOTE(invariant): each prompt prefilled alone (its bucket's graph, else an eager forward of its own) for a few
        # newcomers on CUDA, and for any number in batch-invariant mode: graphs and eager run the same computation
        cuda = self.device.type == "cuda"
        alone = (cuda and invariant.ENABLED) or ((cuda or bool(self.prefill_graphs)) and graphs
                                                 and N <= PREFILL_GRAPH_MAX_REQUESTS and self.block_table is None)
        buckets = [self.prefill_len(1, n) for n in lens] if alone else [self.prefill_len(N, max(lens))] * N
        L = max(buckets)
        r = slice(lo, lo + N)
        fits = lambda sample, k: not sample or 1 <= k <= TOPK_CAP  # noqa: E731
        x = torch.zeros(N, L, D, device=self.device, dtype=self.dtype)  # right-padded with zeros
        for i, (pre, trail, prm) in enumerate(zip(prefills, trailings, params)):
            assert lens[i] < self.max_len and trail.shape[0] <= self.max_len, "call check_prompt first"
            s = lo + i
            x[i, : lens[i]] = pre.to(self.dtype)
            for name, t in self.params.items():
                t[s] = getattr(prm, name)
            self.topk_ok_cpu[s] = fits(prm.do_sample, prm.top_k) and fits(prm.subtalker_dosample, prm.subtalker_top_k)
            self.topk_ok[s] = self.topk_ok_cpu[s]
            self.seed[s] = prm.seed
            self.trailing[s, : trail.shape[0]] = trail.to(self.dtype)
            self.trailing_len[s] = trail.shape[0]
        self.seen[r] = False
        self.num_generated[r] = 0
        last = torch.tensor(lens, device=self.device)
        if alone:
            h = torch.empty(N, D, device=self.device, dtype=self.dtype)
            for i, b in enumerate(buckets):
                graph = self.prefill_graphs.get(b)
                if graph is not None:  # its bucket's captured forward into the scratch cache, then copied into its row
                    self.prefill_in[:, :b] = x[i, :b]
                    self.prefill_last.copy_(last[i:i + 1] - 1)
                    graph.replay()
                    self.kv[:, :, lo + i, :, :b] = self.prefill_kv[:, :, 0, :, :b]
                    h[i] = self.prefill_h[0]
                else:
                    s = slice(lo + i, lo + i + 1)
                    kv, table = (self.kv[:, :, s], None) if self.block_table is None else (self.kv, self.block_table[s])
                    h[i] = self._prefill_forward(x[i:i + 1, :b], kv, table, last[i:i + 1] - 1)[0]
        else:
            kv = self.kv if self.block_table is not None else self.kv[:, :, r]
            table = None if self.block_table is None else self.block_table[r]
            h = self._prefill_forward(x, kv, table, last - 1)
        self.position[r] = last
        self.position_cpu[r] = lens
        self.last_hidden[r] = h
        self._sample_code0(lo, lo + N, h, capped=False)
        return self.last_code0[r].tolist()

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
        NOTE: C1: positions 0..L-1 in every row, so row i's tokens 0..L_i-1 sit exactly where they would alone and
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
    def _sample_code0(self, lo: int, hi: int, h: torch.Tensor, capped: bool, act: torch.Tensor | None = None) -> None:
        """h: [B, D] final talker hidden of rows [lo, hi) -> last_code0; updates history and counters
        (act [B] bool: only of those rows)."""
        t, p, r = self.cfg, self.params, slice(lo, hi)
        logits = linear(h, self.talker.codec_head.weight).float()
        logits = self._rules(logits, self.seen[r], p["repetition_penalty"][r], self.num_generated[r],
                             t.codec_eos_token_id, t.vocab_size - 1024)
        noise = uniform_noise(self.seed[r], self.num_generated[r], 0, logits.shape[-1])
        code0 = self._draw(capped, self.topk_ok[r], logits, p["do_sample"][r], p["temperature"][r], p["top_k"][r],
                           p["top_p"][r], noise)
        if act is None:
            self.seen[r].scatter_(1, code0[:, None], True)
            self.num_generated[r] += 1
            self.last_code0[r] = code0
        else:
            self.seen[r].scatter_(1, code0[:, None], act[:, None] | self.seen[r].gather(1, code0[:, None]))
            self.num_generated[r] += act
            self.last_code0[r] = torch.where(act, code0, self.last_code0[r])

    def _code_predictor(self, B: int, h: torch.Tensor, code0: torch.Tensor, capped: bool) -> torch.Tensor:
        """C2: h [B, D] talker hidden, code0 [B] -> codes 1..K-1 [B, K-1]."""
        cp, p, r = self.talker.code_predictor, self.params, slice(0, B)
        whole = B <= FUSED_CP_MAX_BATCH and self._cp_step_fused is not None and not invariant.ENABLED
        # per layer a (k, v) pair of views (given the one [layers, 2, B, ...] view, torch.compile copied it whole for
        # every write); the step compiled whole has caches of its own
        kv = ([(k[:B], v[:B]) for k, v in self.cp_kv_whole] if whole else
              [(self.cp_kv[i, 0, :B], self.cp_kv[i, 1, :B]) for i in range(self.cp_kv.shape[0])])
        frame = self.num_generated[r] - 1  # this frame's index: noise differs per frame and codebook
        noise_all = frame_noise(self.seed[r], frame, cp.lm_head[0].out_features, 1, self.K - 1)  # [K-1, B, V]
        x = torch.stack([h, self.talker.model.codec_embedding(code0)], dim=1)  # [B, 2, D]
        step = self._cp_step_fused if whole else self._cp_step
        out = []
        for i in range(self.K - 1):
            emb = cp.model.codec_embedding[min(i, self.K - 3)].weight  # (the last step's next input is unused)
            cos, sin, write_pos, mask = (t[:B] for t in self.cp_steps[i])
            code, x = step(x, cos, sin, kv, write_pos, mask, cp.lm_head[i].weight, emb, p["subtalker_dosample"][r],
                           p["subtalker_temperature"][r], p["subtalker_top_k"][r], p["subtalker_top_p"][r],
                           noise_all[i], capped, self.device.type == "cuda" and (whole or i > 0), whole,
                           None if whole else self.topk_ok[r])
            out.append(code)
        return torch.stack(out, dim=1)

    def _cp_step_inputs(self, i: int) -> tuple[torch.Tensor, ...]:
        """The code predictor's step i attends positions 0, 1 (i = 0), then i + 1: its constant inputs for every row,
        (cos, sin [rows, s, Dh], write_pos [rows, s], mask), laid out exactly as the talker's own so that the layers
        compiled for the talker serve these steps too (batches of 2 and more run them through the compiled layers):
        step 0 as a prefill's (write_pos an expanded arange, mask [1, 1, 2, 16]), later steps as a frame's (write_pos
        [rows, 1] a plain tensor like `position`, mask [rows, 1, 1, 16]); inference tensors where the talker's are
        (computed in inference mode). A compiled layer guards on its inputs' dispatch keys, sizes of 1 and strides:
        with one broadcast table for all rows, 4 of a start-up's 24 compilations were these steps' own (H100)."""
        S, dev = self.num_rows, self.device
        pos = torch.arange(2, device=dev) if i == 0 else torch.full((1,), i + 1, device=dev)  # [s]
        write_pos = pos.repeat(S)[:, None] if i > 0 else None  # [S, 1]: a plain tensor, as `position`
        with torch.inference_mode():
            cos, sin = rope_cos_sin(pos[None].expand(S, -1), self.cp_inv_freq, self.dtype)  # [S, s, Dh]
            mask = torch.arange(self.K, device=dev)[None, None, None, :] <= pos[None, None, :, None]  # [1, 1, s, 16]
            if i == 0:
                write_pos = torch.arange(2, device=dev)[None].expand(S, -1)  # [S, 2], as a prefill's positions
            else:
                mask = mask.expand(S, -1, -1, -1).contiguous()  # [S, 1, 1, 16], as a frame's mask
        return cos, sin, write_pos, mask

    def _cp_step(self, x, cos, sin, kv, write_pos, mask, head_w, emb_w, do_sample, temperature, top_k, top_p, noise,
                 capped: bool, fused_attention: bool = False, write_kv_in_attention: bool = False,
                 topk_ok: torch.Tensor | None = None):
        """One code-predictor step: x [B, S, D_talker] (S = 2 at step 0, then 1) -> (code [B], next input
        codec_embedding[i](code) [B, 1, D_talker]). Under torch.compile as a whole (single stream), the norms,
        residuals, head and sampler fuse across layer boundaries. fused_attention (CUDA: the one-token steps, and the
        step compiled whole) puts each layer's attention in one kernel (kernels.decode_attention), which also writes
        the caches with write_kv_in_attention (the step compiled whole). topk_ok [B]: see _draw."""
        ctx = AttnContext(write_pos, mask, fused_attention=fused_attention, write_kv_in_attention=write_kv_in_attention)
        cp = self.talker.code_predictor
        hid = cp(x, cos, sin, kv, ctx, normed=False)[:, -1]  # [B, D_cp] before the final norm
        if gemv_ex_applies(hid, head_w):  # one row on a GPU: the norm rides in the head's kernel
            logits = gemv_ex(hid, head_w, norm=cp.model.norm)
        else:
            logits = linear(cp.model.norm(hid), head_w)
        # (logits in the head's dtype: the samplers compute in fp32, the CUDA one as it loads them)
        if capped:
            code, nxt = self._sample_topk(logits, do_sample, temperature, top_k, top_p, noise, emb=emb_w)
        else:
            code = self._draw(False, topk_ok, logits, do_sample, temperature, top_k, top_p, noise)
            nxt = F.embedding(code, emb_w)
        return code, nxt[:, None]

    def _draw(self, capped: bool, topk_ok: torch.Tensor | None, logits, *args) -> torch.Tensor:
        """Tokens [B] from processed logits [B, V] (args: sample's). capped: the top-k sampler for every row.
        NOTE(invariant): otherwise, in batch-invariant mode, each row whose top-k fits (topk_ok [B]) still takes the
        top-k sampler, as it does alone (a batch runs the full sampler when any of its rows needs it: the draws agree
        but for rounding, and rounding must not depend on the neighbours)."""
        if capped:
            return self._sample_topk(logits, *args)
        full = self._sample(logits, *args)
        if not invariant.ENABLED or topk_ok is None:
            return full
        return torch.where(topk_ok, self._sample_topk(logits, *args), full)

    def _frame(self, B: int, n: int, capped: bool = False) -> None:
        """One whole frame for rows [0, B), attending over n cache positions. Static shapes, no host sync.
        capped: every row's top_k fits TOPK_CAP, so the cheaper top-k sampler draws the same tokens."""
        self._frame_codes(B, capped)
        self._frame_talker(B, n, capped)

    def _frame_codes(self, B: int, capped: bool = False) -> None:
        """Codes 1..15 of the current frame (code predictor) -> frame_codes[:B]."""
        r = slice(0, B)
        code0 = self.last_code0[r]
        codes = self._code_predictor(B, self.last_hidden[r], code0, capped)
        self.frame_codes[r] = torch.cat([code0[:, None], codes], dim=1)

    def _frame_talker(self, B: int, n: int, capped: bool = False) -> None:
        """Talker step on the completed frame -> next hidden and code 0."""
        r = slice(0, B)
        frame_idx = self.num_generated[r] - 1  # frames completed before this one
        x = self.talker.embed_codes(self.frame_codes[r])
        use_text = frame_idx < self.trailing_len[r]
        text = self.trailing[torch.arange(B, device=self.device), frame_idx.clamp(0, self.max_len - 1)]
        x = x + torch.where(use_text[:, None], text, self.tts_pad_embed[None])
        pos = self.position[r][:, None]  # [B, 1]
        kv, ctx = self._kv_ctx(r, pos, self.key_pos[None, None, None, :n] <= pos[:, None, :, None])
        h = self.talker(x[:, None], self.rope_cos[pos], self.rope_sin[pos], kv, ctx)[:, -1]
        act = self.active[r]  # NOTE: a row that sits out writes K/V at its position, rewritten when it runs
        self.position[r] += act
        self.last_hidden[r] = torch.where(act[:, None], h, self.last_hidden[r])
        self._sample_code0(0, B, h, capped, act)

    def append_trailing(self, slot: int, start: int, text: torch.Tensor) -> None:
        """Streamed text: the next embedded text tokens [n, D] of the row in `slot`, at trailing[start:]."""
        n = text.shape[0]
        assert start + n <= self.max_len, "the engine checks the room"
        self.trailing[slot, start:start + n] = text.to(self.dtype)
        self.trailing_len[slot] = start + n

    @torch.inference_mode()
    def decode_frame(self, B: int, active: list[bool]) -> FrameResult:
        """One whole frame for the running rows [0, B); a row with active[row] False sits it out."""
        if active != self.active_cpu[:B]:
            self.active[:B] = torch.tensor(active, device=self.device)
            self.active_cpu[:B] = active
        n = self.kv_span(max(self.position_cpu[:B]) + 1)
        capped = all(self.topk_ok_cpu[:B])
        if self.use_graphs:
            Bp = next(b for b in self.batch_buckets if b >= B)
            graph = self.graphs.get((Bp, n, capped))
            if graph is None:
                raise RuntimeError(f"no CUDA graph for batch {Bp} x length {n}: call capture_graphs() before serving")
            if Bp > B:
                self.position[B:Bp] = 0  # padding rows are free slots: position 0 keeps their writes in the cache
                if self.block_table is not None:
                    self.block_table[B:Bp] = 0  # paged: in the scratch block (a free slot's blocks may be others' now)
            graph.replay()
        else:
            self._frame(B, n, capped)
        for s in range(B):
            self.position_cpu[s] += active[s]
        codes = self.frame_codes[:B].clone()  # stays on the device for the vocoder (the buffer is reused)
        return FrameResult(codes, self.last_code0[:B].tolist())  # the one sync per frame

    # ------------------------------------------------------------------ CUDA graphs
    def graph_keys(self) -> list[tuple[int, int, bool]]:
        """(batch bucket, length bucket, capped sampler): one CUDA graph each."""
        lens, n = [], MIN_KV_SPAN
        while n <= self.max_len:
            lens.append(n)
            n *= 2
        return [(B, n, c) for B in self.batch_buckets for n in lens for c in (True, False)]

    def alloc_prefill_scratch(self) -> None:
        """The prefill graphs' static input and outputs, and a scratch cache of one row (~30 MB for the real models)
        that they write, copied into the admitted row afterwards. The input an inference tensor and the cache not, as
        an eager prefill's: the compiled layers guard on their inputs' dispatch keys (measured: 3 more compilations
        at start-up otherwise)."""
        cfg, D, dev, dt = self.cfg, self.cfg.hidden_size, self.device, self.dtype
        Lp = max(b for b in PREFILL_GRAPH_LENS if b <= self.max_len)
        with torch.inference_mode():
            self.prefill_in = torch.zeros(1, Lp, D, device=dev, dtype=dt)
            self.prefill_last = torch.zeros(1, dtype=torch.long, device=dev)
            self.prefill_h = torch.zeros(1, D, device=dev, dtype=dt)
        self.prefill_kv = torch.zeros(cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, Lp + KV_SPARE,
                                      cfg.head_dim, device=dev, dtype=dt)

    def _prefill_into_scratch(self, L: int) -> None:
        """One request's prefill at padded length L from the static input into the scratch cache (a prefill graph)."""
        self.prefill_h.copy_(self._prefill_forward(self.prefill_in[:, :L], self.prefill_kv, None, self.prefill_last))

    def warm_up_frames(self, keys) -> None:
        """Run one frame per key before capturing (compilation, allocations, cuBLAS handles). Each starts at
        position 0: a frame advances its rows' positions, and a position past the key's span n would write
        outside the n // block_size blocks a paged row attends (an out-of-range index: a device-side assert)."""
        for key in keys:
            self.position.zero_()
            self._frame(*key)

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture one graph per (batch bucket up to the allocated rows, length bucket up to max_len, sampler).
        Must run while no request is active: the warm-up replays write into the rows they cover (all state is
        reset afterwards)."""
        if not self.use_graphs:
            return 0
        keys = self.graph_keys()
        lens = [L for L in PREFILL_GRAPH_LENS if L <= self.max_len] if self.block_table is None else []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # one warm-up frame per (batch bucket, sampler), at its shortest span: the spans share every compiled variant
        # (the span is a dynamic size), and each frame launched from Python took ~0.1 s (84 keys: ~8 s of a start).
        # Paged: every key (on an H100 a longer span compiled a variant of its own there, inside a capture)
        warm = {}
        for B, n, c in sorted(keys):
            warm.setdefault((B, c) if self.block_table is None else (B, n, c), (B, n, c))
        with torch.cuda.stream(stream):
            self.warm_up_frames(list(warm.values()))
            for L in lens:
                self._prefill_into_scratch(L)
        torch.cuda.current_stream().wait_stream(stream)
        compiled = compile_counts()
        with gc_paused():
            for key in sorted(keys, reverse=True):  # largest batch first: the shared pool is sized by it
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    self._frame(*key)
                self._pool = g.pool()
                self.graphs[key] = g
            for L in lens:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    self._prefill_into_scratch(L)
                self.prefill_graphs[L] = g
        # a variant compiled inside a capture (a span that needed its own) is a bug: it ran no warm-up, and its kernels
        # were tuned while capturing
        now = compile_counts()
        self.compiled_while_capturing = now["fx_hit"] + now["fx_miss"] - compiled["fx_hit"] - compiled["fx_miss"]
        if self.compiled_while_capturing:
            log.warning("%d graphs compiled while capturing CUDA graphs", self.compiled_while_capturing)
        # Batched prefills compile apart for 1 and >= 2 rows (and so do the samplers they call), and for <= and >
        # MAX_ROWS tokens in all (the skinny GEMM or cuBLAS): compile the four now, not while the first burst of
        # requests waits (measured on an H200: 5 s for the first 16 concurrent requests). Long prompts run
        # uncompiled (eager_prefill).
        D = self.cfg.hidden_size
        for n in (1, 2)[: self.num_rows]:
            for L in (8, 5 * MAX_ROWS):
                self.prefill_batch(0, [torch.zeros(L, D, device=self.device, dtype=self.dtype)] * n,
                                   [torch.zeros(2, D, device=self.device, dtype=self.dtype)] * n,
                                   [SamplingParams()] * n, graphs=n == 1)  # 2 rows: the batched forward
        # and a prompt past the last prefill graph's length, alone: its forward launched from Python straight into its
        # row, as each of a few (in batch-invariant mode, any number of) long newcomers runs
        L = PREFILL_GRAPH_LENS[-1] + 1
        if L < self.max_len and self.block_table is None and not self.eager_prefill(1, L):
            self.prefill_batch(0, [torch.zeros(L, D, device=self.device, dtype=self.dtype)],
                               [torch.zeros(2, D, device=self.device, dtype=self.dtype)], [SamplingParams()])
        torch.cuda.synchronize()
        for t in self._state_tensors():  # the warm-ups wrote garbage into free rows
            t.zero_()
        for t in self.params.values():
            if t.dtype == torch.float32:
                t.fill_(1.0)
        self.position_cpu = [0] * self.num_rows
        self.topk_ok_cpu = [True] * self.num_rows
        self.active.fill_(True)
        self.active_cpu = [True] * self.num_rows
        torch.cuda.empty_cache()  # the warm-ups' blocks (cached on their side stream, where nothing else reuses them)
        return len(self.graphs)
