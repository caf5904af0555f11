"""dsv4: a portable inference engine for DeepSeek-V4-Flash.

``from dsv4 import LLM, SamplingParams`` is the offline API; importing the package stays cheap
(the engine and torch load on first use).
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
