"""Wire types of the HTTP API (pydantic only: no logic).

`SpeechRequest` is OpenAI's `/v1/audio/speech` body plus Qwen3-TTS extensions. Every constraint that
can be checked without the model is declared here, so a bad request is a 400 before any work starts;
what needs the model (voice names, languages, text length limit) is checked in serving.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from q3tts.config import GenerationDefaults

# the sampling extensions of a request: generation_config.json's fields plus a seed (q3tts.sampling.SamplingParams)
SAMPLING_FIELDS = (*GenerationDefaults.__dataclass_fields__, "seed")

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in JSON): no character, cannot be tokenized
        raise ValueError(f"not valid Unicode text: a lone surrogate U+{ord(s[e.start]):04X} at character "
                         f"{e.start} (a surrogate pair must be complete)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]  # a str that can be encoded (every text field of a request)


class VoiceRef(BaseModel):
    """A custom voice by id, as the OpenAI client sends it: {"id": "voice_..."}."""

    model_config = ConfigDict(extra="forbid")
    id: Text = Field(min_length=1, max_length=128)


class SpeechOptions(BaseModel):
    """How to speak: the /v1/audio/speech fields but the text and the output format."""

    # NOTE: unknown fields are refused (a misspelt "temprature" must not be silently ignored)
    model_config = ConfigDict(extra="forbid")

    # ---- OpenAI fields
    model: Text | None = Field(None, max_length=256, description="Any name: this server serves one model")
    voice: Text | VoiceRef | None = Field(
        None, description="CustomVoice: a built-in speaker; Base: a stored voice id or name; VoiceDesign: ignored")
    instructions: Text | None = Field(
        None, max_length=4096, description="CustomVoice 1.7B: a style instruction; VoiceDesign: the voice in words")

    # ---- extensions
    language: Text | None = Field(None, max_length=64, description='"Auto" (default) or a supported language')
    ref_audio: Text | None = Field(None, description="Base: reference clip as base64 or a data URL (not stored)")
    ref_text: Text | None = Field(None, max_length=4096, description="Base: transcript of ref_audio (ICL)")
    x_vector_only_mode: bool = Field(False, description="Base: use only the speaker embedding of the reference")
    seed: int | None = Field(None, ge=0, lt=2**31)
    do_sample: bool | None = None
    temperature: float | None = Field(None, gt=0, le=10)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    subtalker_dosample: bool | None = None
    subtalker_temperature: float | None = Field(None, gt=0, le=10)
    subtalker_top_k: int | None = Field(None, ge=0)
    subtalker_top_p: float | None = Field(None, gt=0, le=1)
    max_new_tokens: int | None = Field(None, ge=1, le=65536, description="Cap on codec frames + 1 (12.5 per second)")
    non_streaming_mode: bool | None = Field(
        None, description="Prompt text placement (the official meaning); the WebSocket's default is False")

    def gen_kwargs(self) -> dict[str, Any]:
        """The sampling extensions that were given (the model's generation_config fills the rest): every
        SamplingParams field, which this request declares under the same name."""
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}

    @property
    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class LongFormFields(BaseModel):
    """Long form (vLLM-Omni's names and values): the text spoken as segments decoded in parallel, joined in order."""

    split_granularity: Literal["none", "sentence", "clause"] | None = Field(
        None, description="Speak the input as segments decoded in parallel, joined in order (header X-Q3TTS-Split); "
                          "none: one request; not given: one request, or sentences for a text over --max-text-length")
    pause_ms: int | None = Field(None, ge=0, le=10_000, description="Silence between two segments (ms)")


class SpeechRequest(SpeechOptions, LongFormFields):
    """OpenAI's /v1/audio/speech body plus Qwen3-TTS extensions."""

    input: Text = Field(description="The text to speak (at most --max-text-length characters as one request; a "
                       "longer one, up to --max-split-text-length, is split at sentences)")
    response_format: ResponseFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0, description="Tempo factor, pitch preserved (WSOLA)")
    stream_format: Literal["audio", "sse"] = "audio"
    word_timestamps: bool = Field(False, description="Word times (needs `q3tts serve --aligner`): the "
                                  "X-Word-Timestamps header (JSON [{word, start_ms, end_ms}]) of the whole response, "
                                  "or with stream_format sse a speech.audio.word_timestamps event after the audio")
    stream: bool = Field(True, description="False: the whole audio in one answer, with its X-Finish-Reason header "
                                           "(stop | length), Content-Length, and its length in its WAV / FLAC header "
                                           "(a streamed WAV or FLAC cannot state it)")


class SessionConfig(SpeechOptions):
    """The WebSocket's session.config message: how the session's next utterances are spoken (PCM s16le).

    Besides the /v1/audio/speech fields, vLLM-Omni's streaming fields (LiveKit's Qwen3-TTS client sends them);
    the values this server cannot honour are refused by session.SpeechSession with a message naming them."""

    type: Literal["session.config"]
    task_type: str | None = Field(None, max_length=32, description="CustomVoice | VoiceDesign | Base: must be the "
                                                                   "served model's")
    response_format: str | None = Field(None, max_length=16, description="pcm (the only format of the socket)")
    stream_audio: bool = Field(True, description="False: each utterance's audio in one binary message")
    speed: float | None = Field(None, description="1.0 (the socket streams at the native tempo)")
    initial_codec_chunk_frames: int | None = Field(None, ge=1, le=64, description="Frames (80 ms) in the first "
                                                   "audio chunk of each utterance")
    split_granularity: str | None = Field(None, max_length=16, description="none: each flush is one request; "
                                          "sentence | clause: each sentence (clause) a request once its end is known")
    pause_ms: int | None = Field(None, ge=0, le=10_000, description="Silence between two segments (ms)")
    word_timestamps: bool = Field(False, description="vLLM-Omni's form (a server with --aligner): audio as JSON "
                                  "audio.chunk messages, then one with empty audio carrying the utterance's words")
    timestamp_type: str | None = Field(None, max_length=16, description="word: word timestamps in audio.done "
                                                                        "(a server with --aligner)")
    timestamp_transport_strategy: str | None = Field(None, max_length=16)


class VoiceAddMessage(BaseModel):
    """The WebSocket's voice.add message (vLLM-Omni's): clone a reference clip into the voice store (Base)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["voice.add"]
    name: str = Field(min_length=1, max_length=64)
    audio_data: str = Field(min_length=1, description="The reference clip as base64 or a data URL")
    audio_format: str | None = Field(None, max_length=16, description="Accepted; the clip's own header is read")
    ref_text: str | None = Field(None, max_length=4096)
    consent: str | None = Field(None, max_length=256, description="Accepted, recorded nowhere")
    x_vector_only_mode: bool = False


class CreateVoiceRequest(BaseModel):
    """JSON alternative to the multipart upload of POST /v1/audio/voices."""

    model_config = ConfigDict(extra="forbid")
    name: Text = Field(min_length=1, max_length=64)
    audio_sample: Text = Field(min_length=1, description="The reference clip as base64 or a data URL")
    ref_text: Text | None = Field(None, max_length=4096, description="Transcript of the clip (needed for ICL)")
    x_vector_only_mode: bool = False
    consent: Text | None = None  # a consent id (POST /v1/audio/voice_consents) or any string: recorded nowhere
    type: Literal["audio_sample"] = "audio_sample"  # OpenAI's; its "prompt" voices are Live-only there


class VoiceConsent(BaseModel):
    """OpenAI's consent recording object (POST /v1/audio/voice_consents)."""

    id: str
    object: Literal["audio.voice_consent"] = "audio.voice_consent"
    name: str
    language: str
    created_at: int


class VoiceConsentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VoiceConsent]
    has_more: bool = False


class VoiceConsentDeleted(BaseModel):
    id: str
    object: Literal["audio.voice_consent"] = "audio.voice_consent"  # (sic: OpenAI's deleted consent object)
    deleted: bool = True


class VoiceObject(BaseModel):
    id: str
    object: Literal["audio.voice"] = "audio.voice"
    name: str
    created_at: int
    type: Literal["audio_sample", "builtin"]
    # extensions
    mode: Literal["icl", "x_vector", "builtin"] = "builtin"
    ref_text: str | None = None
    model_size: str | None = None
    deletable: bool = False


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VoiceObject]


class VoiceDeleted(BaseModel):
    id: str
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    deleted: bool = True


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "q3tts"
    tts_model_type: str  # custom_voice | voice_design | base
    tts_model_size: str | None = None  # "0b6" | "1b7" (CustomVoice instructions need 1b7)
    sample_rate: int
    languages: list[str]
    voices: list[str]  # built-in speakers (CustomVoice)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    input_tokens: int  # prompt positions (text, speaker, instruction and reference tokens)
    output_tokens: int  # codec frames generated (12.5 per second of audio)
    total_tokens: int


class SpeechAudioDelta(BaseModel):
    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str  # base64 of the next bytes of the stream in response_format


class SpeechAudioDone(BaseModel):
    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: Usage
    finish_reason: str | None = None  # extension: "stop" (EOS), "length", "error"
    audio_seconds: float = 0.0  # extension: duration of the audio sent (after speed)


class WordTiming(BaseModel):
    word: str
    start_ms: int  # from the start of the response's audio
    end_ms: int


class SpeechWordTimestamps(BaseModel):
    """SSE event after the audio deltas of a request with word_timestamps (extension)."""

    type: Literal["speech.audio.word_timestamps"] = "speech.audio.word_timestamps"
    words: list[WordTiming]


class ErrorInfo(BaseModel):
    message: str
    type: str  # invalid_request_error | authentication_error | server_busy | not_found_error | server_error
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ApiError(Exception):
    """An error answer: raised anywhere below the router, turned into ErrorResponse JSON by app.py."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers  # extra response headers, e.g. Retry-After on a 503
