"""The talker (a Qwen3 decoder over codec frames) and its code predictor.

Module names equal the checkpoint keys under `talker.` (e.g. `talker.model.layers.3.mlp.up_proj.weight`,
`talker.code_predictor.lm_head.7.weight`), so loading is an identity map checked key by key.

Per 80 ms frame (see q3tts/engine/runner.py for the loop):
  talker step      : input = embed_codes(previous frame) + trailing text  -> hidden h  -> codec_head -> code 0
  code predictor   : fresh 2-token prefill [proj(h), proj(codec_embedding(code 0))] -> lm_head[0] -> code 1,
                     then step i feeds proj(cp.codec_embedding[i-1](code i)) -> lm_head[i] -> code i+1 (i < 15)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import invariant
from ..config import TalkerConfig
from ..hostcopy import Fill, to_device
from ..kernels import linear
from .layers import DecoderLayer, RMSNorm, run_layers

# What a prompt position holds besides a token id (q3tts.inputs.prompt.PromptLayout): the embedding contract
NONE = -1  # "no part" in a layout slot
SPEAKER = -2  # codec slot filled by the request's x-vector
REF = -3  # codec slots filled by ICL reference frames (in order)


class TalkerModel(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # 3072 x D: codes, specials, speakers
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)  # 151936 x 2048


class TextProjection(nn.Module):
    """text_hidden_size -> text_hidden_size -> hidden_size MLP with biases (upstream's ResizeMLP)."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.text_hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x):
        # plain Linears through kernels.linear (F.linear, unless the batch-invariant mode's kernel serves them).
        # NOTE(invariant): a token's projection is then the same whatever tokens share the call: the whole text at
        # admission, or a streamed text's few new tokens at a time (their number follows the step times, the load)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return linear(F.silu(linear(x, fc1.weight, fc1.bias)), fc2.weight, fc2.bias)


class CodePredictorModel(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        cp = cfg.code_predictor
        self.layers = nn.ModuleList(DecoderLayer(cp) for _ in range(cp.num_hidden_layers))
        self.norm = RMSNorm(cp.hidden_size, cp.rms_norm_eps)
        # NOTE(cp-width): these embeddings have the *talker* width; small_to_mtp_projection maps them down.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cp.vocab_size, cfg.hidden_size) for _ in range(cp.num_code_groups - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        cp = cfg.code_predictor
        self.model = CodePredictorModel(cfg)
        self.lm_head = nn.ModuleList(nn.Linear(cp.hidden_size, cp.vocab_size, bias=False)
                                     for _ in range(cp.num_code_groups - 1))
        # 1.7B: talker 2048 wide, code predictor 1024 -> Linear with bias; 0.6B: same width -> Identity
        self.small_to_mtp_projection = (nn.Linear(cfg.hidden_size, cp.hidden_size, bias=True)
                                        if cp.hidden_size != cfg.hidden_size else nn.Identity())

    def forward(self, x, cos, sin, kv, ctx, normed: bool = True):
        """x: [B, S, D_talker] (talker hidden or codec embeddings) -> hidden [B, S, D_cp], final-normed unless not
        normed (the caller then applies model.norm, e.g. inside the head's kernel)."""
        p = self.small_to_mtp_projection
        # a plain Linear through kernels.linear: F.linear, unless the batch-invariant mode's kernel serves it
        x = linear(x, p.weight, p.bias) if type(p) is nn.Linear else p(x)
        return run_layers(self.model.layers, self.model.norm if normed else None, x, cos, sin, kv, ctx)


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)
        self.codec_table: torch.Tensor | None = None  # the K codec embeddings stacked, by fuse_codec_embeddings()
        self.codec_offsets: torch.Tensor | None = None  # [K] first row of each codebook's table in it

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text token ids [...] -> [..., D]: text_embedding then text_projection. The table may live in host
        memory while the rest of the model is on the GPU (see load_checkpoint): the rows are looked up where the
        table is and projected where the projection is (ids given on the host need no device sync)."""
        table = self.model.text_embedding.weight
        x = F.embedding(ids.to(table.device), table)
        return self.text_projection(x.to(self.codec_head.weight.device))

    def staged_text(self, ids: torch.Tensor) -> Fill | torch.Tensor:
        """Text ids [M] on the host as a section of one staged copy (hostcopy.to_device): where the table lives in
        host memory (load_checkpoint), its rows themselves, gathered straight into the staging buffer (F.embedding's
        values, without a tensor of their own); else the ids. project_staged_text makes embed_text's values of it."""
        table = self.model.text_embedding.weight
        if table.device.type != "cpu":
            return ids
        return Fill((ids.shape[0], table.shape[1]), table.dtype, lambda out: take_rows(table, ids, out))

    def project_staged_text(self, staged: torch.Tensor) -> torch.Tensor:
        """The device copy of a staged_text section (rows [M, text_hidden] or ids [M]) -> [M, D], as embed_text."""
        table = self.model.text_embedding.weight
        x = staged if table.device.type == "cpu" else F.embedding(staged.to(table.device), table)
        return self.text_projection(x.to(self.codec_head.weight.device))

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """A frame of K codes [..., K] -> [..., D]: the sum of its K codec embeddings.

        This is both the next talker input during decoding and an ICL reference frame in the prompt.
        Summed over a stacked dim, like upstream, so the rounding is the same.
        """
        if self.codec_table is not None and invariant.active(self.codec_table):  # each row summed in codebook order
            return invariant.embed_sum(codes, self.codec_offsets, self.codec_table)
        if self.codec_table is not None:  # one lookup: the same [..., K, D] rows, summed the same way
            return F.embedding(codes + self.codec_offsets, self.codec_table).sum(-2)
        embs = [self.model.codec_embedding(codes[..., 0])]
        embs += [e(codes[..., i + 1]) for i, e in enumerate(self.code_predictor.model.codec_embedding)]
        return torch.stack(embs, dim=-2).sum(-2)

    def fuse_codec_embeddings(self) -> None:
        """Stack the K codec embedding tables once after loading (final device and dtype) so that embed_codes is one
        lookup instead of K (a frame's input: 16 launches fewer). The per-codebook tables stay, as views into it."""
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        self.codec_table = torch.cat([t.weight.detach() for t in tables])
        rows = [t.weight.shape[0] for t in tables]
        for t, view in zip(tables, self.codec_table.split(rows)):
            t.weight.data = view
        self.codec_offsets = torch.tensor([sum(rows[:i]) for i in range(len(rows))], device=self.codec_table.device)

    def forward(self, x, cos, sin, kv, ctx):
        """x: [B, S, D] input embeddings -> final-normed hidden [B, S, D]; logits via codec_head."""
        return run_layers(self.model.layers, self.model.norm, x, cos, sin, kv, ctx)


def _prompt_slots(layout, speaker_embedding, ref_codes) -> tuple[np.ndarray, ...]:
    """A layout's host arrays and which of its positions take which part -> (text ids, codec ids, text_at, code_at,
    speaker_at, ref_at); ValueError where the speaker embedding or the reference codes do not match its slots."""
    text = np.asarray(layout.text_ids, dtype=np.int64)
    codec = np.asarray(layout.codec_ids, dtype=np.int64)
    text_at, code_at = np.flatnonzero(text != NONE), np.flatnonzero(codec >= 0)
    speaker_at, ref_at = np.flatnonzero(codec == SPEAKER), np.flatnonzero(codec == REF)
    if speaker_at.size and speaker_embedding is None:
        raise ValueError("this prompt has a speaker slot but no speaker embedding was given")
    if ref_at.size and (ref_codes is None or ref_codes.shape[0] != ref_at.size):
        raise ValueError("ICL prompt: reference codes do not match the layout")
    return text, codec, text_at, code_at, speaker_at, ref_at


def embed_prompt(talker: Talker, layout, speaker_embedding: torch.Tensor | None = None,
                 ref_codes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a symbolic layout (text_ids, codec_ids: one per prefill position; trailing_ids) into
    (prefill [L, D], trailing [S, D]) embeddings.

    speaker_embedding: [D] x-vector for a SPEAKER slot; ref_codes: [T, K] ICL reference frames for REF slots.
    Which slot takes which part is decided on the host (the layout is host data) and every index and id goes to the
    device in one asynchronous copy: no host sync, so a wave of newcomers is embedded at launch speed. The parts are
    added at their positions in a fixed order (text, codec, speaker, reference), as boolean masks would.
    """
    dev = talker.codec_head.weight.device
    dt = talker.codec_head.weight.dtype
    text, codec, text_at, code_at, speaker_at, ref_at = _prompt_slots(layout, speaker_embedding, ref_codes)
    trail = np.asarray(layout.trailing_ids, dtype=np.int64)
    parts = [text_at, code_at, codec[code_at], speaker_at, ref_at, text[text_at], trail]
    host = torch.from_numpy(np.concatenate(parts))
    flat = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
    (text_at, code_at, codes, speaker_at, ref_at, text_dev, trail_dev) = flat.split([len(q) for q in parts])
    # text ids where the text table is (host ids for a table in host memory: load_checkpoint)
    on_host = talker.model.text_embedding.weight.device.type == "cpu"
    x = torch.zeros(len(layout), talker.cfg.hidden_size, device=dev, dtype=dt)
    if text_at.numel():
        x[text_at] += talker.embed_text(torch.from_numpy(parts[5]) if on_host else text_dev)
    if code_at.numel():
        x[code_at] += talker.model.codec_embedding(codes)
    if speaker_at.numel():
        x[speaker_at] += speaker_embedding.to(dev, dt)
    if ref_at.numel():
        x[ref_at] += talker.embed_codes(ref_codes.to(dev))
    trailing = (talker.embed_text(torch.from_numpy(trail) if on_host else trail_dev) if trail.size
                else x.new_zeros(0, talker.cfg.hidden_size))
    return x, trailing


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bits, as an integer dtype


def take_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, H] = table [V, H] rows ids [M] (host tensors; IndexError for an id outside the table), copied bit for
    bit by numpy on the calling thread: torch's index_select spreads a gather of this size over its intra-op
    threads, and waking them costs the engine's step a millisecond or more."""
    bits = _BITS[table.element_size()]
    np.take(table.detach().view(bits).numpy(), ids.numpy(), axis=0, out=out.view(bits).numpy())


def embed_prompts(talker: Talker, layouts: list, speaker_embeddings: list[torch.Tensor | None],
                  ref_codes: list[torch.Tensor | None], L: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A wave of N layouts -> (prefill x [N, L, D] right-padded with zeros, trailing [sum S_i, D]: row i's S_i
    trailing text embeddings after row i-1's), each row as embed_prompt makes it.

    L: the padded length (default: the longest prompt). speaker_embeddings / ref_codes: per layout, as embed_prompt's.
    A constant number of launches for the wave: every host value (slot indices, ids, host-resident x-vectors and
    reference frames, the text rows of a host-resident table) in one asynchronous copy, one text lookup and one
    text projection for all the wave's text (prompts and trailing), one codec lookup, one sum of reference frames.
    NOTE(invariant): a token's projection is computed with the whole wave's text in one call: the same bits as alone
    wherever kernels.linear is row-invariant (batch-invariant mode on CUDA); elsewhere the BLAS may round a row
    differently by the number of rows in the call (see tests/models/test_talker.py).
    """
    dev, dt, D = talker.codec_head.weight.device, talker.codec_head.weight.dtype, talker.cfg.hidden_size
    N = len(layouts)
    L = L or max(len(lay) for lay in layouts)
    dest = {k: [] for k in ("text", "code", "speaker", "ref")}  # flat positions in x [N * L]
    text_ids, code_ids, trail_ids, speaker_of, speakers, refs = [], [], [], [], [], []
    for i, (lay, spk, ref) in enumerate(zip(layouts, speaker_embeddings, ref_codes)):
        assert len(lay) <= L, "L below a prompt's length"
        text, codec, text_at, code_at, speaker_at, ref_at = _prompt_slots(lay, spk, ref)
        for k, at in (("text", text_at), ("code", code_at), ("speaker", speaker_at), ("ref", ref_at)):
            dest[k].append(i * L + at)
        text_ids.append(text[text_at])
        code_ids.append(codec[code_at])
        trail_ids.append(np.asarray(lay.trailing_ids, dtype=np.int64))
        if speaker_at.size:
            speaker_of.append(np.full(speaker_at.size, len(speakers), dtype=np.int64))
            speakers.append(spk)
        if ref_at.size:
            refs.append(ref)
    cat = lambda arrays: torch.from_numpy(np.concatenate(arrays or [np.zeros(0, np.int64)]))  # noqa: E731
    ids = cat(text_ids + trail_ids)  # the prompts' text, then the trailing text
    host = [cat(dest["text"]), cat(dest["code"]), cat(code_ids), cat(dest["speaker"]), cat(speaker_of),
            cat(dest["ref"])]
    # what sits on the host rides in the one copy: the text (its rows where the table lives in host memory:
    # staged_text), x-vectors and reference frames unless they are already on the device
    host.append(talker.staged_text(ids))
    # x-vectors cast on the host: the same rounding as a cast on the device (to nearest even)
    spk_host = bool(speakers) and all(s.device.type == "cpu" for s in speakers)
    ref_host = bool(refs) and all(r.device.type == "cpu" for r in refs)
    if spk_host:
        host.append(torch.stack([s.reshape(-1).to(dt) for s in speakers]))
    if ref_host:
        host.append(torch.cat(refs))
    (text_at, code_at, codes, speaker_at, speaker_of, ref_at, text, *rest) = to_device(host, dev)
    spk = rest.pop(0) if spk_host else (torch.stack([s.reshape(-1).to(dev, dt) for s in speakers]) if speakers
                                        else None)
    ref = rest.pop(0) if ref_host else (torch.cat([r.to(dev) for r in refs]) if refs else None)
    x = torch.zeros(N * L, D, device=dev, dtype=dt)
    if ids.numel():
        text = talker.project_staged_text(text)
    n_text = text_at.shape[0]
    # added in embed_prompt's order (text, codec, speaker, reference); each flat position once per part
    if n_text:
        x[text_at] += text[:n_text]
    if code_at.numel():
        x[code_at] += talker.model.codec_embedding(codes)
    if spk is not None:
        x[speaker_at] += spk[speaker_of]
    if ref is not None:
        x[ref_at] += talker.embed_codes(ref)
    trailing = text[n_text:] if ids.numel() else x.new_zeros(0, D)
    return x.view(N, L, D), trailing
