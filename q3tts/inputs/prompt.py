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

from ..config import ModelConfig
from ..models.talker import REF, SPEAKER
from .request import InputError, PromptLayout

# Qwen2's pre-tokenizer split (the model's own tokenizer; see tests/golden/make_golden.py for the
# official wrapper's local-directory quirk that swaps it for Mistral's).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

ROLE = "assistant\n"  # the text segment is ROLE + text: its first two ids are the role, the rest the body


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
        specials = [t["content"] for _, t in added]
        self.special_prefixes = {c[:k] for c in specials for k in range(1, len(c))}  # for incremental text
        self.max_special_len = max(map(len, specials), default=0)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode of each text (the tokenizers library spreads a batch over its threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """ids and each id's (start, end) character span in text (NFC text: spans are not moved by normalizing)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def normalize(self, text: str) -> str:
        return self._tok.normalizer.normalize_str(text)

    def piece_starts(self, text: str) -> list[int]:
        """Where each pre-tokenizer piece of (NFC) text starts: BPE never merges across them."""
        return [span[0] for _, span in self._tok.pre_tokenizer.pre_tokenize_str(text)]

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i


@dataclass(slots=True)
class PromptSpec:
    """Everything of a request's prompt but its text, resolved (lower case, validated) and tokenized."""

    language: str = "auto"
    speaker: str | None = None  # a CustomVoice speaker
    instruct_ids: list[int] = field(default_factory=list)
    has_xvector: bool = False  # a voice-clone x-vector fills the speaker slot
    ref_ids: list[int] = field(default_factory=list)  # ICL: the reference transcript's tokens
    num_ref_frames: int = 0  # ICL: > 0
    non_streaming_mode: bool = True


class PromptBuilder:
    """Tokenizes and lays out a request's prompt (C4). Its inputs are resolved by q3tts.inputs.processor.

    The text is tokenized as the segment ROLE + text (special tokens split the chat wrapper into segments,
    so these ids are exactly the official ones between <|im_start|> and <|im_end|>): text_ids[:2] are the
    role, text_ids[2:] the body."""

    def __init__(self, cfg: ModelConfig, tokenizer: TextTokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.im_start = tokenizer.token_id("<|im_start|>")

    def text_ids(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise InputError("text is empty: give the words to speak", param="text", code="empty_input")
        return self.tok.encode(ROLE + text)

    def spec(self, language: str = "auto", speaker: str | None = None, instruct: str | None = None,
             has_xvector: bool = False, ref_text: str | None = None, num_ref_frames: int = 0,
             non_streaming_mode: bool = True) -> PromptSpec:
        instruct_ids = self.tok.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n") if instruct else []
        ref_ids = self.tok.encode(ROLE + ref_text)[2:] if num_ref_frames > 0 else []
        return PromptSpec(language, speaker, instruct_ids, has_xvector, ref_ids, num_ref_frames, non_streaming_mode)

    def needed(self, spec: PromptSpec) -> int | None:
        """Text ids the prefill consumes (streaming text layout); None: all of them (non-streaming layouts)."""
        if spec.non_streaming_mode:
            return None
        if spec.num_ref_frames > 0:  # ICL overlays ref_ids + body on codec_bos + the reference frames
            return 2 + max(0, 1 + spec.num_ref_frames - len(spec.ref_ids))
        return 3  # the role + the first body token

    def build(self, spec: PromptSpec, text_ids: list[int], closed: bool = True) -> PromptLayout:
        """The layout of spec + text_ids. closed=False (streaming text): more text follows, so the layout ends
        without tts_eos, which the engine feeds when the text is closed; needs text_ids[:needed(spec)]."""
        c, t = self.cfg, self.cfg.talker
        lang_id = None if spec.language == "auto" else t.codec_language_id[spec.language]
        if spec.speaker is not None and spec.language in ("chinese", "auto") and t.spk_is_dialect.get(spec.speaker):
            lang_id = t.codec_language_id[t.spk_is_dialect[spec.speaker]]  # dialect speakers switch the language id

        p = PromptLayout()
        for tid in spec.instruct_ids + [self.im_start] + text_ids[:2]:
            p.add(text=tid)
        codec = ([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id] if lang_id is None
                 else [t.codec_think_id, t.codec_think_bos_id, lang_id, t.codec_think_eos_id])
        if spec.speaker is not None:
            codec.append(t.spk_id[spec.speaker])
        elif spec.has_xvector:
            codec.append(SPEAKER)
        codec.append(t.codec_pad_id)
        for i, cid in enumerate(codec):
            p.add(text=c.tts_bos_token_id if i == len(codec) - 1 else c.tts_pad_token_id, codec=cid)

        body = text_ids[2:] + ([c.tts_eos_token_id] if closed else [])
        if spec.num_ref_frames > 0:  # ICL
            text_part = spec.ref_ids + body
            codec_part = [t.codec_bos_id] + [REF] * spec.num_ref_frames
            if spec.non_streaming_mode:
                for tid in text_part:
                    p.add(text=tid, codec=t.codec_pad_id)
                for cid in codec_part:
                    p.add(text=c.tts_pad_token_id, codec=cid)
            else:
                for i, cid in enumerate(codec_part):
                    p.add(text=text_part[i] if i < len(text_part) else c.tts_pad_token_id, codec=cid)
                p.trailing_ids = text_part[len(codec_part):]
        elif spec.non_streaming_mode:
            for tid in body:
                p.add(text=tid, codec=t.codec_pad_id)
            p.add(text=c.tts_pad_token_id, codec=t.codec_bos_id)
        else:
            p.add(text=body[0], codec=t.codec_bos_id)
            p.trailing_ids = body[1:]
        return p
