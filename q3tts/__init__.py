"""q3tts: a fast, correct inference engine for the Qwen3-TTS family."""

__version__ = "0.1.0"

from .api import TTS, PreparedRequest, VoiceClonePromptItem  # noqa: E402

__all__ = ["TTS", "PreparedRequest", "VoiceClonePromptItem", "__version__"]
