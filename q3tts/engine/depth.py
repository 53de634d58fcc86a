"""The code predictor's loop (the depth transformer): per frame, codes 1..K-1 of every row from the talker's hidden
state and code 0, with its own caches.

Step 0 prefills [h, codec_embedding(code0)] (2 tokens) -> code 1; steps 1..K-2 each feed the last code's embedding
-> the next code. The attention variant and the sampler of each step are chosen when the loop is built:
  - one row with torch.compile on (`whole`): each step compiled whole (norms, residuals, head and sampler fuse
    across layer boundaries), with caches of its own that its attention kernel writes in place;
  - otherwise the steps run the talker's compiled layers over views of one shared cache, and on CUDA the one-token
    steps put each layer's attention in one kernel (kernels.decode_attention).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import invariant
from ..kernels import gemv_ex, gemv_ex_applies, linear
from ..models.layers import AttnContext, rope_cos_sin, rope_inv_freq
from ..models.talker import Talker
from ..sampling import frame_noise, sample, sample_topk
from .compile import compile_fn
from .memory import KV_SPARE
from .slots import SlotSampling

FUSED_CP_MAX_BATCH = 1  # up to this many rows the step runs compiled whole (BENCHMARKS.md: one stream)


class DepthLoop:
    """Args:
        talker: its code_predictor and codec embeddings are used.
        rows: the engine's slots. samplers: (sample, sample_topk), compiled or not.
        compiled: compile the step whole for batches up to FUSED_CP_MAX_BATCH.
    """

    def __init__(self, talker: Talker, rows: int, samplers: tuple, compiled: bool):
        cp = talker.cfg.code_predictor
        p = next(talker.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.talker, self.rows, self.K = talker, rows, talker.cfg.num_code_groups
        self._sample, self._sample_topk = samplers
        # [layers, k/v, slots, kv heads, K + KV_SPARE, head_dim] (KV_SPARE as in the talker's cache: the steps attend
        # all K positions, never a slice to the end)
        self.kv = torch.zeros(cp.num_hidden_layers, 2, rows, cp.num_key_value_heads, self.K + KV_SPARE, cp.head_dim,
                              device=self.device, dtype=self.dtype)
        self.inv_freq = rope_inv_freq(cp.head_dim, cp.rope_theta).to(self.device)
        self.step_inputs = [self._step_inputs(i) for i in range(self.K - 1)]  # (cos, sin, write_pos, mask) per step
        cuda = self.device.type == "cuda"
        # (capped sampler) -> the step functions of step 0 and of steps 1.. for batches run step by step
        self.steps = {c: (functools.partial(self._step, capped=c, fused_attention=False, write_kv_in_attention=False),
                          functools.partial(self._step, capped=c, fused_attention=cuda, write_kv_in_attention=False))
                      for c in (True, False)}
        self.whole = None
        if compiled:
            # static: 2 step shapes x 2 samplers
            fused = compile_fn(fused_step, cuda=cuda, dynamic=False, fullgraph=True)
            self.whole = {c: functools.partial(fused, talker.code_predictor, capped=c, fused_attention=cuda)
                          for c in (True, False)}
            # The step compiled whole has a cache of its own: per layer a k and a v tensor that alias nothing, which
            # its attention kernel writes in place (AttnContext.write_kv_in_attention). (The batched steps keep views
            # of self.kv: the compiled layer they share with the talker guards on how its inputs alias, and
            # non-aliasing caches compiled it once more.) Under 1 MB, inside memory.NON_TORCH_RESERVE's margin.
            self.kv_whole = [tuple(torch.zeros(min(rows, FUSED_CP_MAX_BATCH), cp.num_key_value_heads,
                                               self.K + KV_SPARE, cp.head_dim, device=self.device, dtype=self.dtype)
                                   for _ in range(2)) for _ in range(cp.num_hidden_layers)]

    def __call__(self, h: torch.Tensor, code0: torch.Tensor, sampling: SlotSampling, seed: torch.Tensor,
                 frame: torch.Tensor, capped: bool, topk_ok: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, D] talker hidden, code0 [B], the rows' sampling parameters, seed [B] and frame index [B] ->
        codes 1..K-1 [B, K-1]. capped: every row fits the top-k sampler; topk_ok [B]: which rows do (see draw)."""
        B = h.shape[0]
        cp = self.talker.code_predictor
        whole = B <= FUSED_CP_MAX_BATCH and self.whole is not None and not invariant.ENABLED
        # per layer a (k, v) pair of views (given the one [layers, 2, B, ...] view, torch.compile copied it whole for
        # every write); the step compiled whole has caches of its own
        kv = ([(k[:B], v[:B]) for k, v in self.kv_whole] if whole else
              [(self.kv[i, 0, :B], self.kv[i, 1, :B]) for i in range(self.kv.shape[0])])
        noise_all = frame_noise(seed, frame, cp.lm_head[0].out_features, 1, self.K - 1)  # [K-1, B, V]
        params = (sampling.subtalker_dosample, sampling.subtalker_temperature, sampling.subtalker_top_k,
                  sampling.subtalker_top_p)
        x = torch.stack([h, self.talker.model.codec_embedding(code0)], dim=1)  # [B, 2, D]
        out = []
        for i in range(self.K - 1):
            step = self.whole[capped] if whole else self.steps[capped][min(i, 1)]
            emb = cp.model.codec_embedding[min(i, self.K - 3)].weight  # (the last step's next input is unused)
            inputs = tuple(t[:B] for t in self.step_inputs[i])
            args = (x, inputs, kv, (cp.lm_head[i].weight, emb), params, noise_all[i])
            code, x = step(*args) if whole else step(*args, topk_ok)
            out.append(code)
        return torch.stack(out, dim=1)

    def _step_inputs(self, i: int) -> tuple[torch.Tensor, ...]:
        """Step i attends positions 0, 1 (i = 0), then i + 1: its constant inputs for every row, (cos, sin
        [rows, s, Dh], write_pos [rows, s], mask), laid out exactly as the talker's own so that the layers compiled
        for the talker serve these steps too (batches of 2 and more run them through the compiled layers): step 0 as
        a prefill's (write_pos an expanded arange, mask [1, 1, 2, 16]), later steps as a frame's (write_pos [rows, 1]
        a plain tensor like `position`, mask [rows, 1, 1, 16]); inference tensors where the talker's are (computed in
        inference mode). NOTE(guards): a compiled layer guards on its inputs' dispatch keys, sizes of 1 and strides:
        one broadcast table for all rows compiled these steps apart."""
        S, dev = self.rows, self.device
        pos = torch.arange(2, device=dev) if i == 0 else torch.full((1,), i + 1, device=dev)  # [s]
        write_pos = pos.repeat(S)[:, None] if i > 0 else None  # [S, 1]: a plain tensor, as `position`
        with torch.inference_mode():
            cos, sin = rope_cos_sin(pos[None].expand(S, -1), self.inv_freq, self.dtype)  # [S, s, Dh]
            mask = torch.arange(self.K, device=dev)[None, None, None, :] <= pos[None, None, :, None]  # [1, 1, s, 16]
            if i == 0:
                write_pos = torch.arange(2, device=dev)[None].expand(S, -1)  # [S, 2], as a prefill's positions
            else:
                mask = mask.expand(S, -1, -1, -1).contiguous()  # [S, 1, 1, 16], as a frame's mask
        return cos, sin, write_pos, mask

    def _step(self, x, inputs, kv, weights, params, noise, topk_ok, *, capped: bool, fused_attention: bool,
              write_kv_in_attention: bool):
        """One step: x [B, S, D_talker] (S = 2 at step 0, then 1), inputs (cos, sin, write_pos, mask), kv per layer
        (k, v), weights (lm_head[i], codec_embedding[i]), params (do_sample, temperature, top_k, top_p) [B], noise
        [B, V] -> (code [B], next input codec_embedding[i](code) [B, 1, D_talker]). fused_attention puts each
        layer's attention in one kernel (kernels.decode_attention), which also writes the caches with
        write_kv_in_attention."""
        head_w, emb_w = weights
        logits = step_logits(self.talker.code_predictor, x, inputs, kv, head_w, fused_attention,
                             write_kv_in_attention)
        if capped:
            code, nxt = self._sample_topk(logits, *params, noise, emb=emb_w)
        else:
            code = self.draw(False, topk_ok, logits, *params, noise)
            nxt = F.embedding(code, emb_w)
        return code, nxt[:, None]

    def draw(self, capped: bool, topk_ok: torch.Tensor | None, logits, *args) -> torch.Tensor:
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


def step_logits(cp, x, inputs, kv, head_w, fused_attention: bool, write_kv_in_attention: bool) -> torch.Tensor:
    """A step's code predictor pass: x [B, S, D_talker], inputs (cos, sin, write_pos, mask), kv per layer (k, v), the
    step's head [V, D_cp] -> logits [B, V] in the head's dtype (the samplers compute in fp32, the CUDA one as it loads
    them)."""
    cos, sin, write_pos, mask = inputs
    ctx = AttnContext(write_pos, mask, fused_attention=fused_attention, write_kv_in_attention=write_kv_in_attention)
    hid = cp(x, cos, sin, kv, ctx, normed=False)[:, -1]  # [B, D_cp] before the final norm
    if gemv_ex_applies(hid, head_w):  # one row on a GPU: the norm rides in the head's kernel
        return gemv_ex(hid, head_w, norm=cp.model.norm)
    return linear(cp.model.norm(hid), head_w)


def fused_step(cp, x, inputs, kv, weights, params, noise, *, capped: bool, fused_attention: bool):
    """The step compiled whole (DepthLoop.whole: up to FUSED_CP_MAX_BATCH rows, caches of its own written by the
    attention kernel): DepthLoop._step with the samplers themselves (sample_topk when capped, else sample; compiled
    inside this graph), as a function of its arguments alone. NOTE(precompile): no object of the engine's among
    them, so its guards are about tensors and constants, which torch can save with the compile cache and the
    artifact (q3tts.engine.compile.compile_fn)."""
    head_w, emb_w = weights
    logits = step_logits(cp, x, inputs, kv, head_w, fused_attention, True)
    if capped:
        code, nxt = sample_topk(logits, *params, noise, emb=emb_w)
    else:
        code = sample(logits, *params, noise)
        nxt = F.embedding(code, emb_w)
    return code, nxt[:, None]
