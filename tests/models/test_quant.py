"""Weight-only quantization (q3tts.models.quant): error bounds per layer, each CPU mode end to end on a tiny
checkpoint (loads, generates, streams, logits close), and clear errors for modes a device does not run."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from torch import nn

from q3tts.kernels import linear
from q3tts.models.quant import QuantLinear, quantize_
from tests.golden import fixtures

CPU_MODES = ("int8", "int4", "int8dyn")
WEIGHT_ONLY = ("int8", "int4")


def step_bound(w: torch.Tensor, mode: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element [N, K]: half a quantization step, the largest |w_q - w| the rounding allows (int8: step =
    max|w_row| / 127; int4: step = (max - min) / 15 over a group of group_size inputs), and max |w| over the
    element's row (int8) or group (int4), the scale of the bf16 roundings of the stored scale and zero."""
    if mode == "int8":
        m = w.abs().amax(1, keepdim=True)
        return (m / 127 / 2).expand_as(w), m.expand_as(w)
    g = w.view(w.shape[0], -1, group_size)
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    return (step / 2).expand_as(g).reshape_as(w), g.abs().amax(-1, keepdim=True).expand_as(g).reshape_as(w)


@pytest.mark.parametrize("mode", WEIGHT_ONLY)
@pytest.mark.parametrize("shape", [(96, 64), (256, 128), (64, 384)])
def test_quant_linear_within_the_step_bound(mode, shape):
    torch.manual_seed(0)
    N, K = shape
    w, b, x = torch.randn(N, K) * 0.05, torch.randn(N), torch.randn(3, 5, K)
    q = QuantLinear(w, b, mode)
    y = q(x)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert y.shape == (3, 5, N) and y.dtype == torch.float32
    # |y_q - y| <= sum_k |x_k| * step_k / 2 (weight rounding: the scales make every level reachable, so the
    # nearest level is within half a step), plus bf16 roundings (relative 2^-9 each) of the activations, of the
    # stored scale (and int4 zero, whose rounding is relative to the group's range, i.e. <= 2 max|w_group|) and of
    # the kernel's output: all within 2^-7 of sum_k |x_k| m_k (m_k >= |w_k|: the row/group max), + 2^-7 |b| for
    # the bias add; fp32 accumulation over K <= 384 terms adds ~K * 2^-24 relative, far below.
    half_step, m = (t.double() for t in step_bound(w, mode, q.group_size))
    xa = x.double().abs()
    bound = xa @ (half_step + 2 ** -7 * m).T + 2 ** -7 * b.double().abs() + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    # and the kernel multiplies by the weight it reports, within the same bound per element (so the packing
    # convention is the one assumed here: a wrong zero point or nibble order is off by whole steps)
    assert ((q.dequantized().double() - w.double()).abs() <= half_step + 2 ** -7 * m + 1e-7).all()


@pytest.mark.parametrize("shape", [(96, 64), (256, 128), (64, 384)])
def test_int8dyn_within_the_weight_and_activation_step_bounds(shape):
    torch.manual_seed(0)
    N, K = shape
    w, b, x = torch.randn(N, K) * 0.05, torch.randn(N), torch.randn(3, 5, K)
    q = QuantLinear(w, b, "int8dyn")
    y = q(x)
    assert y.shape == (3, 5, N) and y.dtype == torch.float32
    # the weight: int8 per channel, within half a step of w (the packed weight is what the kernel multiplies by)
    half_step, _ = (t.double() for t in step_bound(w, "int8", K))
    wq = q.dequantized().double()
    assert ((wq - w.double()).abs() <= half_step + 1e-7).all()
    # the activations: one asymmetric scale over the whole input, range (incl. 0) / 127 (7 bits without VNNI) or
    # / 255, so each x_k moves by at most half a step: |y_q - x @ wq.T - b| <= step / 2 * sum_k |wq_k| (+ fp32 rounding)
    xd = x.double().reshape(-1, K)
    levels = 127 if q.reduce_range else 255
    step = (xd.max().clamp(min=0) - xd.min().clamp(max=0)) / levels
    bound = step / 2 * wq.abs().sum(1) * 1.001 + 1e-5
    ref = xd @ wq.T + b.double()
    assert ((y.double().reshape(-1, N) - ref).abs() <= bound).all()


def test_kernels_linear_runs_a_quantized_module_given_as_weight():
    torch.manual_seed(0)
    q = QuantLinear(torch.randn(64, 64), None, "int8")
    x = torch.randn(2, 64)
    assert q.weight is q and q.shape == (64, 64) and q.device.type == "cpu"
    assert torch.equal(linear(x, q.weight), q(x))


@lru_cache(maxsize=None)
def _tts(mode: str | None):
    from q3tts import TTS
    return TTS.from_pretrained(fixtures.checkpoint("cv06"), device="cpu", dtype=torch.float32, max_batch_size=2,
                               max_seq_len=256, quantization=mode)


def _talker_logits(tts, n_frames=6):
    """Teacher-forced code-0 and code-predictor logits along the unquantized model's greedy codes."""
    from bench.quant_quality import GREEDY, teacher_forced_logits
    base = _tts(None)
    kw = dict(speaker=base.get_supported_speakers()[0], language="English", max_new_tokens=n_frames + 1, **GREEDY)
    pr = base.prepare_custom_voice("Hello there, quantized world.", **kw)
    codes = base.generate_codes(pr)[0][:n_frames]
    return teacher_forced_logits(tts, pr, codes)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_each_cpu_mode_loads_generates_streams_and_stays_close(mode):
    tts = _tts(mode)
    quantized = [m for m in tts.ckpt.talker.modules() if isinstance(m, QuantLinear)]
    # 2 talker + 2 code-predictor layers x (7 projections + fused q|k|v and gate|up), codec_head, 15 heads
    assert len(quantized) == 4 * 9 + 1 + 15 and not any(type(m) is nn.Linear for m in (
        tts.ckpt.talker.codec_head, *tts.ckpt.talker.code_predictor.lm_head))
    assert all(m.mode == mode for m in quantized)
    assert type(tts.ckpt.talker.text_projection.linear_fc1) is nn.Linear  # prompt-only: left dense
    kw = dict(speaker=tts.get_supported_speakers()[0], language="English", max_new_tokens=7, seed=1)
    wavs, sr = tts.generate_custom_voice("Hello there.", **kw)
    chunks = list(tts.generate_custom_voice_stream("Hello there.", **kw))
    streamed = torch.cat([torch.as_tensor(c.audio) for c in chunks])
    assert len(wavs[0]) > 0 and streamed.shape[0] == len(wavs[0])
    # the same codes whether streamed or not (same engine, same seed): the streamed audio equals the offline one
    # up to the vocoder's float reassociation across chunks (tests/engine/test_engine.py holds it to 1e-4)
    assert torch.allclose(streamed, torch.as_tensor(wavs[0]), atol=1e-4)

    ref_t, ref_c = _talker_logits(_tts(None))
    q_t, q_c = _talker_logits(tts)
    # Tolerance: each linear's output moves by about (step / sqrt(12)) * |x| * sqrt(K) against |w| |x| sqrt(K),
    # i.e. relative to its output ~ step / (sqrt(12) * rms(w)). Random Gaussian rows: int8 step = max/127 ~ 4.5
    # sigma / 127 -> ~1% per linear; int4 groups of 32-64: step = range / 15 ~ 4.5 sigma / 15 -> ~9% per linear.
    # These errors are independent across the ~9 linears on a path through the tiny model (2 layers x 3 on the
    # path + heads) and add in quadrature (~3x), and the bf16 activations add 2^-9 each: ~3% (int8), ~27% (int4)
    # of the logits' scale. Held to the max over every logit relative to the largest logit, with ~2x margin.
    # int8dyn adds the activations' rounding: one scale over the row's range / 127 levels (7 bits without VNNI).
    # For Gaussian activations (range ~7 sigma) the step is ~0.055 sigma, ~1.6% of a linear's output (step / sqrt(12)
    # against sigma), but down_proj's input silu(gate) * up is heavy-tailed (range >> 7 sigma): ~3-5% there, so
    # ~5% per linear on the path's mean and ~10% over it (measured: 4% talker, 10% code predictor); same ~2x margin.
    tol = {"int8": 0.06, "int4": 0.5, "int8dyn": 0.2}[mode]
    for q, r in ((q_t, ref_t), (q_c, ref_c)):
        rel = (q - r).abs().max() / r.abs().max()
        assert rel < tol, (mode, float(rel))
        assert rel > 0  # quantized, so not bit-equal: the test would notice if quantization silently did nothing


@pytest.mark.parametrize("mode,device,match", [
    ("int3", "cpu", "unknown quantization 'int3'; accepted: none, int8, int4, fp8, int8dyn"),
    ("fp8", "cpu", "not available on cpu; accepted on cpu: none, int8, int4, int8dyn"),
    ("int8dyn", "cuda", "not available on cuda; accepted on cuda: none, int8, fp8"),
    ("int4", "cuda", "not available on cuda; accepted on cuda: none, int8, fp8"),
])
def test_a_bad_mode_is_a_clear_error(mode, device, match):
    talker = nn.Module()
    with pytest.raises(ValueError, match=match):
        quantize_(talker, mode, device)


def test_from_pretrained_rejects_a_bad_mode_before_loading():
    from q3tts import TTS
    with pytest.raises(ValueError, match="accepted: none, int8, int4, fp8, int8dyn"):
        TTS.from_pretrained(fixtures.checkpoint("cv06"), device="cpu", quantization="int2")


def test_none_leaves_the_model_untouched():
    tts = _tts(None)
    assert not any(isinstance(m, QuantLinear) for m in tts.ckpt.talker.modules())
    quantize_(tts.ckpt.talker, "none", "cpu")
    assert not any(isinstance(m, QuantLinear) for m in tts.ckpt.talker.modules())


def test_quantized_cpu_vocoder_is_bf16_only_with_amx(monkeypatch):
    """Quantized on a CPU with AMX tiles the vocoder runs in bf16 (its convolutions on AMX); unquantized, or without
    AMX (bf16 convolutions emulated), it keeps the model dtype."""
    from q3tts import TTS
    from q3tts.models.loaders import vocoder_dtype
    cpu = torch.device("cpu")
    for amx in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert vocoder_dtype(cpu, torch.float32, None) == torch.float32
        assert vocoder_dtype(cpu, torch.float32, "int4") == (torch.bfloat16 if amx else torch.float32)
    assert vocoder_dtype(torch.device("cuda"), torch.bfloat16, "int8") == torch.bfloat16
    # loaded that way, it streams the offline audio's waveform, not its bits: the streaming and the whole-utterance
    # decodes round differently, and bf16 keeps 8 significant bits, which this random tiny decoder's ~30 layers
    # compound to ~15% rms of the signal (measured: 14.5%, correlation 0.989; 1e-5 in fp32). Held to a correlation of
    # 0.9: a wrong state or a misplaced chunk decorrelates the waveform (measured: another seed's stream 0.24, the
    # stream one frame late 0.24, its first frame moved to the end 0.17)
    tts = TTS.from_pretrained(fixtures.checkpoint("cv06"), device="cpu", quantization="int8")
    assert next(tts.ckpt.code2wav.parameters()).dtype == torch.bfloat16
    assert next(tts.ckpt.talker.parameters()).dtype == torch.float32
    kw = dict(speaker=tts.get_supported_speakers()[0], language="English", max_new_tokens=5, seed=1)
    wavs, _ = tts.generate_custom_voice("Hello there.", **kw)
    streamed = np.concatenate([c.audio for c in tts.generate_custom_voice_stream("Hello there.", **kw)])
    assert streamed.dtype == np.float32 and streamed.shape == wavs[0].shape and np.isfinite(streamed).all()
    assert np.corrcoef(streamed, wavs[0])[0, 1] > 0.9
