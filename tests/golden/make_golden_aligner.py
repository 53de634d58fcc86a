"""Make the forced-aligner golden fixtures: a tiny random checkpoint run through the official `qwen-asr==0.0.6`.

    python tests/golden/make_golden_aligner.py     # creates .oracle-venv-asr/ if needed, then writes fixtures/aligner/

Outside the venv this script only creates the isolated oracle environment (qwen-asr 0.0.6, transformers 4.57.6,
CPU torch 2.13) and re-runs itself inside it; inside, it builds a tiny checkpoint in the official layout (names and
shapes from the official `Qwen3ASRForConditionalGeneration`, values from `q3tts/randomckpt.py`), runs the official
`Qwen3ForcedAligner.align` in fp32 on CPU for English, Chinese and mixed texts, alone and batched, and writes
`fixtures/aligner/aligner.json` (the recipe, the cases, their words and times) and
`fixtures/aligner/tensors.safetensors` (the input audio, the features and token ids the official processor made, the raw timestamp classes).

Notes on the oracle:
- The real checkpoint's files (Qwen/Qwen3-ForcedAligner-0.6B) are not in our reference set: the tiny config keeps the
  official defaults where they shape the computation (128 mel bins, 100-frame conv chunks, the special-token ids and
  80 ms timestamp classes of third-party ports) and shrinks the widths.
- The official `from_pretrained` loads the processor with `fix_mistral_regex=True`; the tiny tokenizer is the Qwen2
  BPE of the TTS checkpoints plus the aligner's special tokens (randomckpt.aligner_tokenizer_config).
- The official audio encoder, on its default (sdpa / eager) attention, attends over a whole utterance; on
  flash-attention 2 (and in qwen-asr's vLLM backend) within windows of `n_window_infer` mel frames. Most cases keep
  their audio inside one window, where both agree; `long_windowed` records the windowed form (the official
  encoder with its own window mask, `_prepare_attention_mask`), `long_sdpa` the default attention on the same input.
- Japanese (nagisa) and Korean (soynlp) word splitting are recorded only if those packages installed in the venv.
- The product (q3tts) is never imported here except `q3tts/randomckpt.py`, loaded by file path.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import ensure_venv  # noqa: E402 (the oracle venv, made as the TTS fixtures' is)

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures" / "aligner"
REFERENCE = ROOT / "q3tts" / "reference"
VENV = ROOT / ".oracle-venv-asr"
ORACLE_PINS = ["torch==2.13.0", "transformers==4.57.6", "accelerate==1.12.0", "librosa", "soundfile"]
# Korean / Japanese word splitting; nagisa builds DyNet from source where no wheel fits: may fail, then Japanese is
# skipped (qwen_asr imports nagisa at module level: a stub stands in)
OPTIONAL = ("soynlp==0.0.493", "nagisa==0.2.11")
STUBS = {"nagisa.py": "# stub: nagisa did not install; Japanese cases are skipped\nSTUB = True\n"}
SEED = 4321
TWEAKS = {"timestamp_embed_scale": 0.02}


def tiny_config() -> dict:
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 activation_function="gelu", max_source_positions=1500, n_window=50, n_window_infer=800,
                 conv_chunksize=500, downsample_hidden_size=8, output_dim=32)
    text = dict(vocab_size=152064, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=65536,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "interleaved": True})
    thinker = dict(audio_config=audio, text_config=text, audio_token_id=151676, audio_start_token_id=151669,
                   classify_num=5000, model_type="qwen3_forced_aligner_thinker")
    return dict(architectures=["Qwen3ASRForConditionalGeneration"], model_type="qwen3_asr", thinker_config=thinker,
                timestamp_token_id=151705, timestamp_segment_time=80, support_languages=LANGUAGES)


# Qwen3-ForcedAligner's languages as its model card lists them (the real config.json is not in our reference set)
LANGUAGES = ["Chinese", "English", "Cantonese", "French", "German", "Italian", "Japanese", "Korean", "Portuguese",
             "Russian", "Spanish"]


PREPROCESSOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "hop_length": 160,
                "n_fft": 400, "sampling_rate": 16000, "chunk_length": 30, "n_samples": 480000, "nb_max_frames": 3000,
                "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0,
                "processor_class": "Qwen3ASRProcessor"}

T_EN = "Hello world! This is a tiny test of the aligner, don't worry."
T_ZH = "你好，今天天气真不错。我们去公园散步吧。"
T_MIX = "我们用Qwen3 TTS合成speech，然后align它。OK?"
T_JA = "今日はいい天気ですね。"
T_KO = "안녕하세요 오늘 날씨가 좋네요."

# audio name -> (seconds, sample rate); each is a deterministic mix of tones and noise (see make_audio)
AUDIO = {"a": (1.37, 16000), "b": (2.5, 16000), "c": (3.61, 16000), "d": (2.05, 24000), "long": (9.3, 8000),
         "short": (0.63, 16000)}
CASES = [
    dict(name="en", audio=["c"], text=[T_EN], language=["English"]),
    dict(name="zh", audio=["b"], text=[T_ZH], language=["Chinese"]),
    dict(name="mixed", audio=["a"], text=[T_MIX], language=["Chinese"]),
    dict(name="en_24k", audio=["d"], text=[T_EN], language=["english"]),
    dict(name="batch", audio=["c", "b", "a"], text=[T_EN, T_ZH, T_MIX], language=["English", "Chinese", "Chinese"]),
    dict(name="batch_one_language", audio=["a", "c"], text=[T_MIX, T_EN], language=["French"]),
    # under one 100-frame conv chunk, alone and beside a longer row (whose chunks are padded to 100 frames)
    dict(name="short", audio=["short"], text=["Hi there."], language=["English"]),
    dict(name="batch_short", audio=["short", "b"], text=["Hi there.", T_ZH], language=["English", "Chinese"]),
    # longer than one attention window (n_window_infer = 800 frames = 8 s): run with the official encoder's own
    # window mask (`_prepare_attention_mask`, its stand-in for the flash-attention-2 windows); "long_sdpa" is the
    # same input on the default attention, which attends across windows
    dict(name="long_windowed", audio=["long"], text=[T_EN + " " + T_EN], language=["English"], windowed=True),
    dict(name="long_sdpa", audio=["long"], text=[T_EN + " " + T_EN], language=["English"]),
    dict(name="ja", audio=["b"], text=[T_JA], language=["Japanese"], needs="nagisa"),
    dict(name="ko", audio=["b"], text=[T_KO], language=["Korean"], needs="soynlp"),
]


def make_audio(seconds: float, sr: int, seed: int):
    import numpy as np
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sr))) / sr
    wav = np.zeros_like(t)
    for f in rng.uniform(100, 3000, size=5):
        amplitude = rng.uniform(0.05, 0.2)
        wav += amplitude * np.sin(2 * np.pi * f * t) * (0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t))
    wav += 0.02 * rng.standard_normal(t.shape)
    return wav.astype(np.float32)


# --------------------------------------------------------------------------- inside the oracle venv
class Windowed:
    """Within the block: the official audio attention gets the official window mask from cu_seqlens."""

    def __init__(self, tower):
        from qwen_asr.core.transformers_backend import modeling_qwen3_asr as m
        self.cls, self.tower, self.orig = m.Qwen3ASRAudioAttention, tower, m.Qwen3ASRAudioAttention.forward

    def __enter__(self):
        tower, orig = self.tower, self.orig

        def forward(attn, hidden_states, cu_seqlens=None, attention_mask=None, **kw):
            if attention_mask is None:
                attention_mask = tower._prepare_attention_mask(hidden_states, cu_seqlens)
            return orig(attn, hidden_states, cu_seqlens=cu_seqlens, attention_mask=attention_mask, **kw)

        self.cls.forward = forward

    def __exit__(self, *exc):
        self.cls.forward = self.orig


def run_inside() -> None:
    import numpy as np
    import torch
    from qwen_asr import Qwen3ForcedAligner
    from qwen_asr.core.transformers_backend import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration
    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("randomckpt", ROOT / "q3tts" / "randomckpt.py")
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)

    cfg = tiny_config()
    with torch.device("meta"):
        model = Qwen3ASRForConditionalGeneration(Qwen3ASRConfig(**cfg))
    assert "forced_aligner" in model.thinker.config.model_type, "the tiny config must build the classify head"
    shapes = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
    ckpt = Path(os.environ.get("TMPDIR", "/tmp")) / "q3tts-golden-aligner"
    digest = rc.write_aligner_checkpoint(ckpt, cfg, shapes, REFERENCE / "tokenizer", PREPROCESSOR, seed=SEED,
                                       tweaks=TWEAKS)
    aligner = Qwen3ForcedAligner.from_pretrained(str(ckpt), dtype=torch.float32)
    aligner.model.eval()

    audio = {k: make_audio(s, sr, seed=i) for i, (k, (s, sr)) in enumerate(sorted(AUDIO.items()))}
    tensors = {f"audio.{k}": torch.from_numpy(v) for k, v in audio.items()}

    # Record what the official processor made (features, ids) and the raw classes at the timestamp positions.
    captured: dict = {}
    orig_thinker = aligner.model.thinker.forward

    def spy(**kw):
        out = orig_thinker(**kw)
        captured.update(kw, logits=out.logits)
        return out

    aligner.model.thinker.forward = spy
    have_nagisa = not getattr(sys.modules.get("nagisa"), "STUB", False)
    have = {"nagisa": have_nagisa, "soynlp": importlib.util.find_spec("soynlp") is not None}
    cases = []
    for case in CASES:
        if case.get("needs") and not have[case["needs"]]:
            print(f"skip {case['name']}: {case['needs']} is not installed")
            continue
        items = [(audio[a], AUDIO[a][1]) for a in case["audio"]]
        windowed = Windowed(aligner.model.thinker.audio_tower) if case.get("windowed") else contextlib.nullcontext()
        lang = case["language"] if len(case["language"]) > 1 else case["language"][0]
        with windowed:
            results = aligner.align(audio=items if len(items) > 1 else items[0],
                                    text=case["text"] if len(items) > 1 else case["text"][0], language=lang)
        ids = captured["input_ids"]
        classes = captured["logits"].argmax(-1)
        rec = dict(case, results=[[[it.text, it.start_time, it.end_time] for it in r] for r in results])
        for i in range(len(items)):
            tensors[f"{case['name']}.{i}.classes"] = classes[i][ids[i] == cfg["timestamp_token_id"]].contiguous()
            tensors[f"{case['name']}.{i}.input_ids"] = ids[i][captured["attention_mask"][i].bool()].contiguous()
            if len(items) == 1 and "long" not in case["audio"]:  # (the long cases' features: 0.5 MB each)
                n = int(captured["feature_attention_mask"][i].sum())
                tensors[f"{case['name']}.{i}.features"] = captured["input_features"][i, :, :n].contiguous()
        cases.append(rec)
        print(case["name"], [[w for w, *_ in r][:6] for r in rec["results"]])

    # the monotonic fix-up alone, on hand-made and random slot sequences (ties, leading / trailing / long runs)
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor
    proc = Qwen3ForceAlignProcessor()
    rng = np.random.default_rng(SEED)
    seqs = [[0.0, 80.0, 160.0], [0.0, 800.0, 160.0, 240.0], [0.0, 80.0, 800.0, 900.0, 160.0],
            [0.0, 900.0, 800.0, 700.0, 400.0], [500.0, 400.0, 300.0, 0.0, 80.0, 160.0],
            [0.0, 80.0, 160.0, 90.0, 50.0, 20.0], [0.0, 100.0, 50.0, 50.0, 50.0, 200.0],
            [0.0, 80.0, 900.0, 950.0, 990.0, 240.0, 320.0]]
    seqs += [(rng.integers(0, 12, size=int(rng.integers(1, 30))) * 80.0).tolist() for _ in range(300)]
    fixups = [[q, proc.fix_timestamp(np.array(q, dtype=np.float32))] for q in seqs]

    OUT.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(OUT / "tensors.safetensors"))
    manifest = dict(oracle="qwen-asr==0.0.6, transformers==4.57.6, torch==2.13.0 (CPU, fp32)", seed=SEED, tweaks=TWEAKS,
                    config=cfg, preprocessor=PREPROCESSOR, shapes=shapes, digest=digest,
                    audio={k: dict(seconds=s, sample_rate=sr) for k, (s, sr) in AUDIO.items()}, cases=cases,
                    fixups=fixups)
    (OUT / "aligner.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    print(f"wrote {OUT}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        run_inside()
        return
    py = ensure_venv(VENV, ORACLE_PINS, "qwen-asr==0.0.6", OPTIONAL, STUBS)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run([str(py), __file__, "--inside"], check=True, env=env)


if __name__ == "__main__":
    main()
