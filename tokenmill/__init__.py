"""tokenmill: a small, readable LLM inference and serving engine.

The public names load lazily so that `tokenmill.core` (which must not import torch) stays light.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "LoRARequest", "__version__"]

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.lora.request import LoRARequest
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill import outputs

        return getattr(outputs, name)
    if name == "LoRARequest":
        from tokenmill.lora.request import LoRARequest

        return LoRARequest
    if name == "EngineArgs":
        from tokenmill.config import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
