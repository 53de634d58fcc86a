"""Text tokenizer and the talker's prompt layout for every mode (C4 in DESIGN.md).

A prompt is laid out symbolically, position by position, before any weight is touched: each prefill
position is the sum of an optional *text* part (a text token through text_projection) and an optional
*codec* part (a codec id, the speaker x-vector, or an ICL reference frame). Tests compare the layout
with the embeddings the official builder produced, token for token.

The layouts follow `Qwen3TTSForConditionalGeneration.generate` of qwen-tts 0.1.1:
  [instruct]  <|im_start|>user\\n{instruct}<|im_end|>\\n                          text only
  role        <|im_start|> assistant \\n                                           text only
  codec tag   (nothink, think_bos, think_eos) | (think, think_bos, lang, think_eos) text tts_pad
              [speaker]                                                          text tts_pad
              codec_pad                                                          text tts_bos
  then, by mode:
  streaming text (non_streaming_mode=False): first text token + codec_bos; the rest of the text and
      tts_eos are fed one per frame ("trailing text"), then tts_pad.
  non-streaming: every text token and tts_eos with codec_pad, then tts_pad + codec_bos; no trailing.
  ICL (Base, with ref codes): text = ref_text tokens + text tokens + tts_eos, codec = codec_bos + the
      reference frames; non-streaming puts them one after the other, streaming overlays them
      position by position and leaves the text surplus as trailing text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .config import ModelConfig

# Qwen2's pre-tokenizer split (the model's own tokenizer; see tests/golden/make_golden.py for the
# official wrapper's local-directory quirk that swaps it for Mistral's).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

NONE = -1  # "no part" in a layout slot
SPEAKER = -2  # codec slot filled by the request's x-vector
REF = -3  # codec slots filled by ICL reference frames (in order)


class TextTokenizer:
    """Qwen2 byte-level BPE built from vocab.json + merges.txt + tokenizer_config.json."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        missing = [f for f in ("vocab.json", "merges.txt", "tokenizer_config.json") if not (d / f).exists()]
        if missing:
            raise FileNotFoundError(f"{d}: missing text tokenizer file(s): {', '.join(missing)}")
        vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
        merges = [tuple(line.split(" ")) for line in (d / "merges.txt").read_text(encoding="utf-8").splitlines()
                  if line and not line.startswith("#version")]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = sorted(cfg.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
        for _, t in added:
            token = AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                               rstrip=t.get("rstrip", False), normalized=t.get("normalized", False),
                               special=t.get("special", False))
            (tok.add_special_tokens if t.get("special") else tok.add_tokens)([token])
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i


@dataclass(slots=True)
class PromptLayout:
    """One request's talker prompt, position by position.

    text_ids[i]  : text token at prefill position i, or NONE
    codec_ids[i] : codec id at position i, or NONE, SPEAKER (x-vector) or REF (next ICL ref frame)
    trailing_ids : text tokens fed one per frame after the prefill (streaming-text mode), then tts_pad
    """

    text_ids: list[int] = field(default_factory=list)
    codec_ids: list[int] = field(default_factory=list)
    trailing_ids: list[int] = field(default_factory=list)

    def add(self, text: int = NONE, codec: int = NONE) -> None:
        self.text_ids.append(text)
        self.codec_ids.append(codec)

    def __len__(self) -> int:
        return len(self.text_ids)


class PromptBuilder:
    """Resolves speaker / language / dialect / instruct and lays out a request's prompt."""

    def __init__(self, cfg: ModelConfig, tokenizer: TextTokenizer):
        self.cfg, self.tok = cfg, tokenizer

    # ---------------------------------------------------------------- validation
    def resolve_language(self, language: str | None) -> str:
        lang = "auto" if language is None else str(language).strip().lower()
        if lang not in self.cfg.languages:
            raise ValueError(f"Unsupported language {language!r}. Supported: {self.cfg.languages}")
        return lang

    def resolve_speaker(self, speaker: str | None) -> str | None:
        if speaker is None or str(speaker).strip() == "":
            return None
        spk = str(speaker).strip().lower()
        if spk not in self.cfg.talker.spk_id:
            raise ValueError(f"Unsupported speaker {speaker!r}. Supported: {self.cfg.speakers}")
        return spk

    # ---------------------------------------------------------------- token ids
    def _assistant_ids(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text is empty: give the words to speak")
        return self.tok.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def _instruct_ids(self, instruct: str | None) -> list[int]:
        if instruct is None or instruct == "":
            return []
        return self.tok.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n")

    def _ref_text_ids(self, ref_text: str) -> list[int]:
        return self.tok.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")[3:-2]

    # ---------------------------------------------------------------- layout
    def build(self, text: str, language: str | None = "auto", speaker: str | None = None,
              instruct: str | None = None, has_xvector: bool = False, ref_text: str | None = None,
              num_ref_frames: int = 0, non_streaming_mode: bool = True) -> PromptLayout:
        """speaker: a CustomVoice name; has_xvector: a voice-clone embedding fills the speaker slot;
        ref_text + num_ref_frames > 0: ICL. Arguments are assumed resolved (lower case, validated)."""
        c, t = self.cfg, self.cfg.talker
        ids = self._assistant_ids(text)
        lang = self.resolve_language(language)
        lang_id = None if lang == "auto" else t.codec_language_id[lang]
        if speaker is not None and lang in ("chinese", "auto") and t.spk_is_dialect.get(speaker):
            lang_id = t.codec_language_id[t.spk_is_dialect[speaker]]  # dialect speakers switch the language id

        p = PromptLayout()
        for tid in self._instruct_ids(instruct):
            p.add(text=tid)
        for tid in ids[:3]:
            p.add(text=tid)
        codec = ([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id] if lang_id is None
                 else [t.codec_think_id, t.codec_think_bos_id, lang_id, t.codec_think_eos_id])
        if speaker is not None:
            codec.append(t.spk_id[speaker])
        elif has_xvector:
            codec.append(SPEAKER)
        codec.append(t.codec_pad_id)
        for i, cid in enumerate(codec):
            p.add(text=c.tts_bos_token_id if i == len(codec) - 1 else c.tts_pad_token_id, codec=cid)

        body = ids[3:-5]
        if num_ref_frames > 0:  # ICL
            text_part = self._ref_text_ids(ref_text) + body + [c.tts_eos_token_id]
            codec_part = [t.codec_bos_id] + [REF] * num_ref_frames
            if non_streaming_mode:
                for tid in text_part:
                    p.add(text=tid, codec=t.codec_pad_id)
                for cid in codec_part:
                    p.add(text=c.tts_pad_token_id, codec=cid)
            else:
                for i, cid in enumerate(codec_part):
                    p.add(text=text_part[i] if i < len(text_part) else c.tts_pad_token_id, codec=cid)
                p.trailing_ids = text_part[len(codec_part):]
        elif non_streaming_mode:
            for tid in body + [c.tts_eos_token_id]:
                p.add(text=tid, codec=t.codec_pad_id)
            p.add(text=c.tts_pad_token_id, codec=t.codec_bos_id)
        else:
            p.add(text=ids[3], codec=t.codec_bos_id)
            p.trailing_ids = ids[4:-5] + [c.tts_eos_token_id]
        return p
