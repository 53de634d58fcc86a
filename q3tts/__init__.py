"""q3tts: a fast, correct inference engine for the Qwen3-TTS family."""

__version__ = "0.1.0"
__all__ = ["TTS", "PreparedRequest", "VoiceClonePromptItem", "ForcedAligner", "WordTime", "split_text",
           "__version__"]


def __getattr__(name: str):  # lazy: torch-free modules (config, the server's protocol, the scheduler) stay torch-free
    if name not in __all__:
        raise AttributeError(f"module 'q3tts' has no attribute {name!r}")
    if name in ("ForcedAligner", "WordTime"):
        from . import align
        return getattr(align, name)
    if name == "split_text":  # pure Python: no torch import for it
        from .inputs.split import split_text
        return split_text
    from . import api, inputs
    return getattr(api, name, None) or getattr(inputs.request, name)
