"""Device memory: what the engine allocates, and how many slots x positions fit a budget.

Everything the engine holds for a slot grows with its positions (the talker KV cache, 112 KiB per position for
0.6B and 1.7B alike: 28 layers x k/v x 8 KV heads x 128 x bf16; the trailing text, 2 KiB per position for 0.6B)
or is fixed per slot (code-predictor KV, code-0 history, vocoder state: ~2.6 MiB). Workspaces (the vocoder's
largest call, the largest prefill's attention scores, the decode frame's activations) are bounded by caps, not by
the slot count. So the sizing is a pure function of a few byte counts; `plan` fits slots x positions into what is
left of a budget after the weights and the workspaces, and `device_room` reads that budget from the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MIB, GIB = 1 << 20, 1 << 30
DEFAULT_SEQ_LEN = 4096  # positions per slot when the budget allows (5 min of audio after a short prompt)
MIN_SEQ_LEN = 256  # never size below this: a prompt + ~15 s of audio
DEFAULT_MAX_SLOTS = 32  # the most slots sizing chooses on its own (more: --max-concurrent)
CPU_MAX_SLOTS = 4  # on a CPU: a few streams at once (one 0.6B stream runs at ~0.5x real time on 2 cores, int8dyn)
HOST_MEMORY_FRACTION = 0.5  # on a CPU, the default budget: this share of the host's available memory
# Measured / bounded workspace constants (bf16, eager; compile only lowers them)
VOCODER_BYTES_PER_FRAME_ROW = 8 * MIB  # one frame of one row through Code2Wav.decode_step (~6 MiB measured, CPU)
VOCODER_FIXED = 64 * MIB
NON_TORCH_RESERVE = 512 * MIB  # CUDA graph executables, cuBLAS / cuDNN workspaces, Triton modules, fragmentation


# A contiguous KV cache holds this many positions past its last length bucket, never written or attended: a frame's
# span then never reaches the end of the cache, where torch.compile compiled each layer variant apart (a slice to the
# end is contiguous: more compilations of the decoder layer in a start-up)
KV_SPARE = 1
# A wave of more newcomers than the runner prefills one by one replays one batched prefill graph per chunk of up to
# the largest of these rows, at the least of these padded lengths that holds its prompts (engine.runner): one graph
# per (size, length) that fits the slots and max_len, all writing one scratch cache of the largest
PREFILL_WAVE_SIZES = (16, 32, 64)
PREFILL_WAVE_LENS = (32, 64, 128)


@dataclass(slots=True)
class SlotBytes:
    """Bytes the engine allocates per slot: per_position * positions + fixed."""

    per_position: int
    fixed: int

    def __call__(self, positions: int) -> int:
        return self.per_position * positions + self.fixed


def kv_bytes_per_position(talker_cfg, elem: int = 2) -> int:
    t = talker_cfg
    return t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * elem


def vocoder_state_bytes(code2wav, dtype) -> int:
    """One stream's StreamingVocoder state (its row of the pool)."""
    row = code2wav.init_state(1, "meta", dtype)
    return sum(t.nbytes for t in (*row.tails, row.keys, row.values))


def slot_bytes(talker_cfg, elem: int = 2, vocoder_state: int = 3 * MIB) -> SlotBytes:
    """Per-slot bytes of a talker config (elem: bytes per element of the model dtype), with a contiguous KV cache
    (its KV_SPARE positions are in the fixed part)."""
    t, cp = talker_cfg, talker_cfg.code_predictor
    kv = kv_bytes_per_position(t, elem)
    trailing = t.hidden_size * elem  # trailing text embedding, per position
    cp_kv = cp.num_hidden_layers * 2 * cp.num_key_value_heads * (t.num_code_groups + KV_SPARE) * cp.head_dim * elem
    seen = t.vocab_size  # bool code-0 history
    return SlotBytes(kv + trailing, KV_SPARE * kv + cp_kv + seen + vocoder_state + 64 * 1024)


def prefill_workspace(talker_cfg, max_len: int, max_prefill_tokens: int, max_slots: int, elem: int = 2) -> int:
    """Bound on the transient bytes of the largest batched prefill: attention scores of one KV head at a time
    (q3tts.models.layers chunks larger ones by head) at ~4 live bytes + elem per score (scores, fp32 softmax,
    probabilities), plus the hidden and MLP activations of all its tokens."""
    t = talker_cfg
    G = t.num_attention_heads // t.num_key_value_heads
    tokens = min(max_slots * max_len, max(max_prefill_tokens, max_len))  # N * Lmax of the largest prefill
    scores = G * tokens * max_len * (4 + 2 * elem)
    acts = tokens * (4 * t.hidden_size + 3 * t.intermediate_size + t.num_attention_heads * t.head_dim * 3) * elem
    return scores + acts


def wave_buckets(max_slots: int, max_len: int) -> tuple[list[int], list[int]]:
    """The batched prefill graphs' wave sizes and padded lengths for these slots and positions."""
    return ([n for n in PREFILL_WAVE_SIZES if n <= max_slots], [n for n in PREFILL_WAVE_LENS if n <= max_len])


def wave_scratch_bytes(talker_cfg, max_slots: int, max_len: int, elem: int = 2) -> int:
    """The batched prefill graphs' scratch: a KV cache of the largest wave x the longest padded length (+ KV_SPARE)
    and its padded prompt embeddings (contiguous caches on CUDA; 0 where no bucket fits)."""
    sizes, lens = wave_buckets(max_slots, max_len)
    if not sizes or not lens:
        return 0
    N, L = max(sizes), max(lens)
    return N * ((L + KV_SPARE) * kv_bytes_per_position(talker_cfg, elem) + L * talker_cfg.hidden_size * elem)


def vocoder_workspace(max_slots: int, max_piece: int, max_call_frames: int) -> int:
    """The streaming vocoder's largest call: rows x piece frames, capped at max_call_frames."""
    frames = min(max_call_frames, max_slots * max_piece)
    return VOCODER_FIXED + frames * VOCODER_BYTES_PER_FRAME_ROW


def paged_workspace(talker_cfg, max_slots: int, max_len: int, elem: int = 2) -> int:
    """A paged cache's frame gathers each row's positions into contiguous keys and values (a copy: no paged
    attention kernel): up to 3 such tensors of [slots, kv heads, positions, head_dim] live at once, per layer."""
    t = talker_cfg
    return 3 * max_slots * max_len * t.num_key_value_heads * t.head_dim * elem


def workspace(talker_cfg, max_slots: int, max_len: int, elem: int = 2, max_prefill_tokens: int = 8192,
              max_piece: int = 16, max_call_frames: int = 64, paged: bool = False) -> int:
    """What the engine needs beyond weights and per-slot state (the sizing's reserve)."""
    return (NON_TORCH_RESERVE + prefill_workspace(talker_cfg, max_len, max_prefill_tokens, max_slots, elem)
            + vocoder_workspace(max_slots, max_piece, max_call_frames)
            + (paged_workspace(talker_cfg, max_slots, max_len, elem) if paged
               else wave_scratch_bytes(talker_cfg, max_slots, max_len, elem)))


@dataclass(slots=True)
class Plan:
    max_slots: int
    max_seq_len: int
    room: int  # bytes available for the engine after the weights
    state: int  # per-slot state of the plan (KV, trailing text, ...)
    workspace: int  # reserved workspaces of the plan

    def describe(self) -> str:
        return (f"{self.max_slots} slots x {self.max_seq_len} positions: state {self.state / GIB:.2f} GiB + "
                f"workspace {self.workspace / GIB:.2f} GiB of {self.room / GIB:.2f} GiB available")


def plan(room: int, per_slot, reserve, max_slots: int | None = None, max_seq_len: int | None = None,
         cap_slots: int = DEFAULT_MAX_SLOTS, min_seq_len: int = MIN_SEQ_LEN) -> Plan:
    """Choose the slots and positions not given so that slots * per_slot(positions) + reserve(slots, positions)
    fits `room` bytes. Positions stay at DEFAULT_SEQ_LEN (or max_seq_len) while one slot fits there, with as many
    slots as fit (at most cap_slots); positions halve (not below min_seq_len) only when not even one slot fits.
    Given values are kept as they are. ValueError naming the budget if nothing fits.

    Args:
        room: bytes the engine may allocate beyond the loaded weights.
        per_slot: positions -> bytes per slot (a SlotBytes).
        reserve: (slots, positions) -> workspace bytes.
    """
    def need(s, n):
        return s * per_slot(n) + reserve(s, n)

    def fail(s, n):
        raise ValueError(f"{s} slot(s) x {n} positions need {need(s, n) / GIB:.2f} GiB but the memory budget leaves "
                         f"{room / GIB:.2f} GiB after the weights; raise the budget (--gpu-memory / "
                         f"--gpu-memory-utilization), quantize the weights, or lower --max-concurrent / --max-seq-len")

    lens = [max_seq_len] if max_seq_len else [DEFAULT_SEQ_LEN >> i for i in range(16)
                                              if DEFAULT_SEQ_LEN >> i >= min(min_seq_len, DEFAULT_SEQ_LEN)]
    if max_slots:
        for n in lens:
            if need(max_slots, n) <= room:
                return Plan(max_slots, n, room, max_slots * per_slot(n), reserve(max_slots, n))
        fail(max_slots, lens[-1])
    for n in lens:
        s = 0
        for k in range(1, cap_slots + 1):  # reserve may grow with slots: count up (cap_slots is small)
            if need(k, n) > room:
                break
            s = k
        if s:
            return Plan(s, n, room, s * per_slot(n), reserve(s, n))
    fail(1, lens[-1])
    raise AssertionError  # unreachable


def budget_bytes(total: int, gpu_memory_utilization: float | None = None, gpu_memory_gb: float | None = None) -> int:
    """This process's budget: an absolute size (GB = 1e9 bytes, for devices shared with other work) or a fraction
    of the device's total memory (default 0.9)."""
    if gpu_memory_gb is not None:
        if not gpu_memory_gb > 0:
            raise ValueError(f"gpu_memory must be > 0 GB, got {gpu_memory_gb}")
        return int(gpu_memory_gb * 1e9)
    u = 0.9 if gpu_memory_utilization is None else gpu_memory_utilization
    if not 0 < u <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u}")
    return int(u * total)


def device_room(device, gpu_memory_utilization: float | None = None, gpu_memory_gb: float | None = None) -> int:
    """Bytes the engine may still allocate on a CUDA device: the budget less what PyTorch holds now (the weights),
    and never more than the device has free (other processes count there)."""
    import torch
    device = torch.device(device)
    if device.index is None:  # "cuda": the current device (get_per_process_memory_fraction needs an index)
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    cap = _fraction_cap(torch, device, total)  # a process limited to part of the device sees that part as its GPU
    budget = budget_bytes(cap, gpu_memory_utilization, gpu_memory_gb)
    return max(0, min(min(budget, cap) - held, free))


def host_room(memory_utilization: float | None = None, memory_gb: float | None = None) -> int:
    """Bytes a CPU engine may allocate: a share of the host memory available now (default HOST_MEMORY_FRACTION; the
    rest stays for the activations and other programs), or an absolute size; never more than is available."""
    avail = _host_available()
    u = HOST_MEMORY_FRACTION if memory_utilization is None else memory_utilization
    return min(budget_bytes(avail, u, memory_gb), avail)


def _host_available() -> int:
    """MemAvailable of /proc/meminfo (free + reclaimable cache); elsewhere the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _fraction_cap(torch, device, total: int) -> int:
    """The allocator's own limit (torch.cuda.set_per_process_memory_fraction), or total if none is set."""
    try:
        frac = torch.cuda.get_per_process_memory_fraction(device)
    except (AttributeError, RuntimeError):
        return total
    return int(frac * total) if frac and frac < 1 else total


def alloc_len(max_seq_len: int, min_span: int = 64) -> int:
    """Positions the runner allocates for max_seq_len (a power of two, its last length bucket)."""
    return max(min_span, 1 << (max_seq_len - 1).bit_length())


def size_engine(ckpt, max_slots: int | None, max_seq_len: int | None, gpu_memory_utilization: float | None = None,
                gpu_memory: float | None = None, max_call_frames: int = 64,
                block_size: int | None = None) -> tuple[int, int, int | None]:
    """The engine's (max_slots, max_seq_len, num_blocks): the given ones, the rest fitted to the memory budget: on
    CUDA a share of the GPU (device_room; at most DEFAULT_MAX_SLOTS slots), on a CPU a share of the host memory
    available after loading (host_room, the same two options; at most CPU_MAX_SLOTS slots). Logs the plan.
    ValueError if nothing fits; given sizes that exceed the budget only warn unless a budget was given too.
    block_size: a paged KV cache (see paged_blocks); num_blocks is None without one."""
    import logging

    import torch
    log = logging.getLogger("q3tts.engine")
    cuda = ckpt.device.type == "cuda"
    cap = DEFAULT_MAX_SLOTS if cuda else CPU_MAX_SLOTS
    if cuda:
        torch.cuda.empty_cache()  # loading's temporaries
    cfg, elem = ckpt.cfg.talker, ckpt.dtype.itemsize
    per = slot_bytes(cfg, elem, vocoder_state_bytes(ckpt.code2wav, ckpt.dtype))
    if cuda:
        room = device_room(ckpt.device, gpu_memory_utilization, gpu_memory)
        held = f"weights {torch.cuda.memory_allocated(ckpt.device) / GIB:.2f} GiB"
    else:
        room = host_room(gpu_memory_utilization, gpu_memory)
        held = "host memory, after the weights"
    if block_size:
        slots, n = max_slots or cap, max_seq_len or DEFAULT_SEQ_LEN
        kv = kv_bytes_per_position(cfg, elem)
        blocks = paged_blocks(room - workspace(cfg, slots, alloc_len(n), elem, max_call_frames=max_call_frames,
                                               paged=True),
                              slots, alloc_len(n), block_size, kv,
                              SlotBytes(per.per_position - kv, per.fixed - KV_SPARE * kv))
        if blocks is None:
            raise ValueError(f"a paged KV cache for {slots} slot(s) x {n} positions does not fit the memory budget: "
                             f"{room / GIB:.2f} GiB ({held}); raise the budget or lower --max-concurrent / "
                             "--max-seq-len")
        log.info("memory (%s): paged KV: %d blocks of %d positions (%.2f GiB, %d positions in all) for %d slots of "
                 "up to %d positions", held, blocks, block_size, blocks * block_size * kv / GIB,
                 (blocks - 1) * block_size, slots, n)
        return slots, n, blocks

    def reserve(s, n):
        return workspace(cfg, s, alloc_len(n), elem, max_call_frames=max_call_frames)

    def per_slot(n):
        return per(alloc_len(n))

    try:
        p = plan(room, per_slot, reserve, max_slots, max_seq_len, cap_slots=cap)
    except ValueError as e:
        if max_slots and max_seq_len and gpu_memory_utilization is None and gpu_memory is None:
            log.warning("memory: %s (estimate; going on as asked)", e)
            return max_slots, max_seq_len, None
        raise ValueError(f"{e} ({held})") from None
    log.info("memory (%s): %s", held, p.describe())
    return p.max_slots, p.max_seq_len, None


def paged_blocks(room: int, slots: int, positions: int, block_size: int, kv_per_position: int,
                 other_per_slot: SlotBytes) -> int | None:
    """Blocks of a paged KV cache in `room` bytes (after the workspace) beside the slots' other state
    (other_per_slot: trailing text, code-predictor KV, ...): never more than contiguous caches would take
    (slots x positions, + the scratch block); None unless one stream of `positions` fits (+ scratch)."""
    blocks = (room - slots * other_per_slot(positions)) // (block_size * kv_per_position)
    blocks = min(blocks, slots * positions // block_size + 1)
    return blocks if blocks >= positions // block_size + 1 else None
