"""The shared model runtime. Offline use: `from engine import LLM, SamplingParams`."""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # LLM pulls in torch and the model code; importing it lazily keeps `import engine` light.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
