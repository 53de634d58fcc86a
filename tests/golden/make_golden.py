"""Make the golden fixtures: tiny random checkpoints run through the official `qwen-tts==0.1.1`.

    python tests/golden/make_golden.py            # creates .oracle-venv/ if needed, then writes fixtures/

Outside the venv this script only creates the isolated oracle environment and re-runs itself inside
it; inside, it builds each tiny checkpoint in the official layout (names and shapes from the official
classes, values from `q3tts/randomckpt.py`), runs the official public API with greedy decoding in
fp32 on CPU, and writes for each variant `fixtures/<variant>/manifest.json` (the checkpoint recipe,
the cases and their inputs) and `fixtures/<variant>/outputs.safetensors` (codes, waveforms, the
prompt embeddings the official builder produced, token ids).

Notes on the oracle:
- CPU torch 2.13 has no torchaudio; qwen_tts imports `torchaudio.compliance.kaldi` (and sox,
  onnxruntime) only for its 25 Hz tokenizer, so empty stub modules are placed in the venv.
- The official wrapper loads its text tokenizer with `fix_mistral_regex=True`. For a *local*
  directory whose config.json says transformers 4.57.3, transformers 4.57.3 then swaps the Qwen2
  pre-tokenizer regex for Mistral's; for a hub id (the documented usage) it does not. We follow the
  hub-id behaviour (the model's own Qwen2 tokenizer) and reload the processor with
  `fix_mistral_regex=False` so the fixtures record that.
- The product (q3tts) is never imported here except `q3tts/randomckpt.py`, loaded by file path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
REFERENCE = ROOT / "q3tts" / "reference"
VENV = ROOT / ".oracle-venv"
ORACLE_PINS = ["torch==2.13.0", "transformers==4.57.3", "accelerate==1.12.0", "librosa", "soundfile", "einops"]

GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=33)  # at most 32 frames
SEED = 1234


# --------------------------------------------------------------------------- the oracle venv
# modules qwen_tts imports only for its 25 Hz tokenizer: empty stubs (CPU torch 2.13 has no torchaudio)
TTS_STUBS = {f: "# stub: only qwen_tts's 25 Hz tokenizer uses this module\n" for f in (
    "torchaudio/__init__.py", "torchaudio/compliance/__init__.py", "torchaudio/compliance/kaldi.py", "sox.py",
    "onnxruntime.py")}


def ensure_venv(venv: Path = VENV, pins: list[str] = ORACLE_PINS, oracle: str = "qwen-tts==0.1.1",
                optional: tuple[str, ...] = (), stubs: dict[str, str] = TTS_STUBS) -> Path:
    """An isolated oracle environment, made once: the pins, the oracle package without its dependencies, then the
    optional packages (allowed to fail); stubs ({path under site-packages: text}) are written where that module is
    missing. Returns its python. Shared by every make_golden*.py."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *pins], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", oracle], check=True)
        for pkg in optional:
            subprocess.run([str(py), "-m", "pip", "install", "-q", pkg], check=False)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for f, text in stubs.items():
        path = site / f
        if not path.exists() and not path.with_suffix("").is_dir():  # (a package of that name is the real one)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return py


# --------------------------------------------------------------------------- tiny configs
def tiny_config(kind: str, size: str) -> dict:
    """Shrink a real config.json; keep every id table, the text vocab and the codec vocab."""
    real = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}[kind]
    src = "1.7B" if (size == "1b7" or kind == "voice_design") else "0.6B"
    cfg = json.loads((REFERENCE / f"{src}-{real}.config.json").read_text())
    t = cfg["talker_config"]
    cp = t["code_predictor_config"]
    if size == "0b6":  # talker width == code-predictor width: small_to_mtp_projection is Identity
        hidden, head_dim, section = 64, 32, [6, 5, 5]  # 4 heads x 32 = 128 > hidden, as in the real 0.6B
    else:  # talker wider than the code predictor: a Linear projection
        hidden, head_dim, section = 96, 16, [4, 2, 2]
    t.update(hidden_size=hidden, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=head_dim, text_hidden_size=32)
    t["rope_scaling"]["mrope_section"] = section
    cp.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)
    cfg["tts_model_size"] = size
    if kind == "base":
        cfg["speaker_encoder_config"] = dict(enc_dim=hidden, sample_rate=24000, mel_dim=128,
                                             enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
                                             enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16,
                                             enc_res2net_scale=4, enc_se_channels=16)
    return cfg


def tiny_speech_config() -> dict:
    cfg = json.loads((REFERENCE / "speech_tokenizer.config.json").read_text())
    cfg["decoder_config"].update(latent_dim=32, codebook_dim=16, decoder_dim=32, hidden_size=32, intermediate_size=64,
                                 head_dim=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                                 sliding_window=8, vector_quantization_hidden_dimension=16)
    cfg["encoder_config"].update(hidden_size=32, intermediate_size=64, num_filters=4, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=16, num_hidden_layers=2, codebook_dim=16,
                                 vector_quantization_hidden_dimension=16, upsample_groups=32, sliding_window=16)
    return cfg


# variant -> (kind, size, tweaks)
VARIANTS = {
    "cv06": ("custom_voice", "0b6", {"output_conv_scale": 0.015}),
    "cv17": ("custom_voice", "1b7", {"output_conv_scale": 0.015}),
    "vd17": ("voice_design", "1b7", {"output_conv_scale": 0.015}),
    "base06": ("base", "0b6", {"output_conv_scale": 0.015}),
    "base17": ("base", "1b7", {"output_conv_scale": 0.015}),
    # cv06 with the EOS row of codec_head a scaled copy of code 1441's (cv06/auto_nsm's first code): greedy
    # decoding then stops by itself, which exercises the EOS ban of the first 2 frames and per-row stops
    "cv06eos": ("custom_voice", "0b6", {"output_conv_scale": 0.015, "eos_copy_from": 1441, "eos_scale": 1.05}),
}

T_LONG = "Hello world! This is a tiny test of the Qwen3 TTS engine, don't worry."
T_ZH = "你好，今天天气真不错。我们去公园散步吧。"
T_MIX = "HelloWorld 123 it's a mixed-case test, ok?"
T_SHORT = "Hi."


def cases_for(variant: str) -> list[dict]:
    """Each case is one call of the official public API (kwargs stored verbatim, tensors by name)."""
    if variant == "cv06eos":
        return [c for c in cases_for("cv06") if c["name"] in ("auto_nsm", "english_stream", "batch_mixed")]
    if variant == "cv06":
        return [
            dict(name="auto_nsm", method="generate_custom_voice", kw=dict(text=T_LONG, speaker="Vivian", language="Auto", non_streaming_mode=True)),
            dict(name="english_stream", method="generate_custom_voice", kw=dict(text=T_LONG, speaker="ryan", language="English", non_streaming_mode=False)),
            dict(name="dialect_eric_chinese", method="generate_custom_voice", kw=dict(text=T_ZH, speaker="eric", language="chinese", non_streaming_mode=True)),
            dict(name="dialect_dylan_auto_stream", method="generate_custom_voice", kw=dict(text=T_ZH, speaker="Dylan", language="Auto", non_streaming_mode=False)),
            dict(name="instruct_ignored_0b6", method="generate_custom_voice", kw=dict(text=T_MIX, speaker="aiden", language="English", instruct="Speak very happily.", non_streaming_mode=True)),
            dict(name="batch_mixed", method="generate_custom_voice", kw=dict(text=[T_SHORT, T_ZH, T_MIX], speaker=["vivian", "dylan", "serena"], language=["Auto", "Chinese", "Japanese"], non_streaming_mode=True)),
        ]
    if variant == "cv17":
        return [
            dict(name="instruct_nsm", method="generate_custom_voice", kw=dict(text=T_LONG, speaker="uncle_fu", language="English", instruct="Very angry, shouting.", non_streaming_mode=True)),
            dict(name="korean_stream", method="generate_custom_voice", kw=dict(text=T_MIX, speaker="sohee", language="Korean", non_streaming_mode=False)),
            dict(name="dialect_instruct_stream", method="generate_custom_voice", kw=dict(text=T_ZH, speaker="eric", language="Auto", instruct="用欢快的语气说。", non_streaming_mode=False)),
            dict(name="batch_mixed_stream", method="generate_custom_voice", kw=dict(text=[T_LONG, T_SHORT], speaker=["ryan", "ono_anna"], language=["English", "Auto"], instruct=["Whisper softly.", ""], non_streaming_mode=False)),
        ]
    if variant == "vd17":
        return [
            dict(name="auto_nsm", method="generate_voice_design", kw=dict(text=T_LONG, instruct="A deep, calm male voice.", language="Auto", non_streaming_mode=True)),
            dict(name="french_stream", method="generate_voice_design", kw=dict(text=T_MIX, instruct="Young woman, cheerful and fast.", language="French", non_streaming_mode=False)),
            dict(name="empty_instruct", method="generate_voice_design", kw=dict(text=T_SHORT, instruct="", language="English", non_streaming_mode=True)),
            dict(name="batch", method="generate_voice_design", kw=dict(text=[T_ZH, T_LONG], instruct=["温柔的女声。", "An old man."], language=["Chinese", "English"], non_streaming_mode=False)),
        ]
    # base: voice_clone_prompt items given directly (x-vector and ICL); tensors are made in run_variant
    return [
        dict(name="xvec_stream", method="generate_voice_clone", kw=dict(text=T_LONG, language="English", non_streaming_mode=False), prompt=[("xvec", 0, None)]),
        dict(name="xvec_auto_nsm", method="generate_voice_clone", kw=dict(text=T_MIX, language="Auto", non_streaming_mode=True), prompt=[("xvec", 1, None)]),
        dict(name="icl_short_ref_stream", method="generate_voice_clone", kw=dict(text=T_LONG, language="English", non_streaming_mode=False), prompt=[("icl", 0, 5)]),
        dict(name="icl_long_ref_stream", method="generate_voice_clone", kw=dict(text=T_SHORT, language="Auto", non_streaming_mode=False), prompt=[("icl", 1, 40)]),
        dict(name="icl_nsm", method="generate_voice_clone", kw=dict(text=T_ZH, language="Chinese", non_streaming_mode=True), prompt=[("icl", 2, 12)]),
        dict(name="batch_mixed_stream", method="generate_voice_clone", kw=dict(text=[T_SHORT, T_LONG, T_ZH], language=["English", "Auto", "Chinese"], non_streaming_mode=False), prompt=[("xvec", 0, None), ("icl", 0, 5), ("icl", 1, 40)]),
    ]


REF_TEXTS = ["Okay. Yeah. I resent you.", "这是一段参考音频的文本。", "The quick brown fox."]


# --------------------------------------------------------------------------- inside the oracle venv
def run_inside(only: list[str] | None) -> None:
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel, VoiceClonePromptItem
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from safetensors.torch import save_file
    from transformers import AutoProcessor

    spec = importlib.util.spec_from_file_location("randomckpt", ROOT / "q3tts" / "randomckpt.py")
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)
    torch.manual_seed(0)

    def shapes_of(module) -> dict:
        return {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in module.state_dict().items()}

    gen_cfg = json.loads((REFERENCE / "generation_config.json").read_text())
    for variant, (kind, size, tweaks) in VARIANTS.items():
        if only and variant not in only:
            continue
        cfg, scfg = tiny_config(kind, size), tiny_speech_config()
        with torch.device("meta"):
            shapes = shapes_of(Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**cfg)))
            speech_shapes = shapes_of(Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**scfg)))
        ckpt = Path(os.environ.get("TMPDIR", "/tmp")) / f"q3tts-golden-{variant}"
        digests = rc.write_checkpoint(ckpt, cfg, scfg, shapes, speech_shapes, REFERENCE / "tokenizer", gen_cfg,
                                      seed=SEED, tweaks=tweaks)
        tts = Qwen3TTSModel.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
        tts.processor = AutoProcessor.from_pretrained(str(ckpt), fix_mistral_regex=False)  # see module doc
        model = tts.model

        # Record what the official builder feeds the talker, and the token ids it made.
        captured: dict = {}
        orig_generate = model.talker.generate

        def spy_generate(*a, **kw):
            captured["embeds"], captured["mask"] = kw["inputs_embeds"], kw["attention_mask"]
            captured["trailing"] = kw["trailing_text_hidden"]
            return orig_generate(*a, **kw)

        model.talker.generate = spy_generate
        orig_tok = tts._tokenize_texts

        def spy_tok(texts):
            out = orig_tok(texts)
            captured.setdefault("ids", []).extend([(t, o[0].tolist()) for t, o in zip(texts, out)])
            return out

        tts._tokenize_texts = spy_tok
        orig_decode = model.speech_tokenizer.decode

        def spy_decode(encoded):
            captured["codes"] = [e["audio_codes"] for e in encoded]
            return orig_decode(encoded)

        model.speech_tokenizer.decode = spy_decode

        tensors: dict = {}
        cases = cases_for(variant)
        g = torch.Generator().manual_seed(SEED)
        spk_embs = [torch.randn(cfg["talker_config"]["hidden_size"], generator=g) for _ in range(3)]
        for case in cases:
            captured.clear()
            kw = dict(case["kw"])
            if "prompt" in case:
                items = []
                for j, (mode, spk_i, ref_len) in enumerate(case["prompt"]):
                    ref_code = None
                    if mode == "icl":
                        ref_code = torch.randint(0, 2048, (ref_len, 16), generator=g)
                        tensors[f"{case['name']}.ref_code.{j}"] = ref_code
                    tensors[f"{case['name']}.ref_spk_embedding.{j}"] = spk_embs[spk_i].clone()
                    items.append(VoiceClonePromptItem(ref_code=ref_code, ref_spk_embedding=spk_embs[spk_i],
                                                      x_vector_only_mode=mode == "xvec", icl_mode=mode == "icl",
                                                      ref_text=REF_TEXTS[spk_i] if mode == "icl" else None))
                case["prompt_ref_text"] = [REF_TEXTS[s] if m == "icl" else None for m, s, _ in case["prompt"]]
                kw["voice_clone_prompt"] = items
            wavs, sr = getattr(tts, case["method"])(**kw, **GREEDY)
            assert sr == 24000
            n = len(wavs)
            lens = captured["mask"].sum(1).tolist()
            L = captured["embeds"].shape[1]
            for i in range(n):
                # left-padded by the official builder: strip the padding
                tensors[f"{case['name']}.prefill.{i}"] = captured["embeds"][i, L - int(lens[i]):].contiguous()
                tensors[f"{case['name']}.wav.{i}"] = torch.from_numpy(np.ascontiguousarray(wavs[i]))
                peak = float(np.abs(wavs[i]).max())
                assert peak < 0.95, f"{variant}/{case['name']}: waveform peak {peak} too close to the clamp"
            tensors[f"{case['name']}.trailing"] = captured["trailing"].contiguous()
            for i, c in enumerate(captured["codes"]):
                tensors[f"{case['name']}.codes.{i}"] = c.contiguous()  # [T, 16]; ICL: ref codes in front
            case["num_frames"] = [int(c.shape[0]) for c in captured["codes"]]
            case["token_ids"] = captured["ids"]
            case["num_rows"] = n
        if variant == "cv06":  # decoder alone: a long input exercises upstream's 300-frame chunking
            codes = torch.randint(0, 2048, (330, 16), generator=g)
            wavs, _ = orig_decode([{"audio_codes": codes}, {"audio_codes": codes[:37]}])
            tensors["decode_long.codes"] = codes
            tensors["decode_long.wav.0"] = torch.from_numpy(np.ascontiguousarray(wavs[0]))
            tensors["decode_long.wav.1"] = torch.from_numpy(np.ascontiguousarray(wavs[1]))

        out = FIXTURES / variant
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "outputs.safetensors"))
        manifest = dict(variant=variant, kind=kind, size=size, seed=SEED, tweaks=tweaks, digests=digests,
                        greedy=GREEDY, config=cfg, speech_config=scfg, generation_config=gen_cfg,
                        shapes=shapes, speech_shapes=speech_shapes, cases=cases,
                        oracle="qwen-tts==0.1.1, transformers==4.57.3, torch==2.13.0+cpu, fp32, eager attention")
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
        print(f"{variant}: " + ", ".join(f"{c['name']}={c['num_frames']}" for c in cases), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("variants", nargs="*", help=f"subset of {list(VARIANTS)}")
    args = ap.parse_args()
    if args.inside:
        run_inside(args.variants)
        return
    py = ensure_venv()
    subprocess.run([str(py), __file__, "--inside", *args.variants], check=True)


if __name__ == "__main__":
    main()
