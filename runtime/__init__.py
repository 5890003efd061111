"""The runtime: everything above the engine session (sampler, detokenizer, chat templates, KV block manager,
continuous-batching scheduler) and the Python API.

    from engine.runtime import LLM, SamplingParams
    outputs = LLM("engine_dir").generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

It reads only an engine directory; it never imports recipes/, builder/ or transformers, and imports torch only to
run a tensor-parallel engine (runtime/tp/, torch.distributed) or a TensorRT one. Two clients of the API live in
sub-packages of their own: server/ (`engine serve`, the only code that imports the web stack) and benchmark/
(`engine bench`); nothing else in runtime/ imports them.
"""
from .llm import LLM
from .outputs import EngineStats, RequestMetrics, RequestOutput
from .sampling_params import Logprob, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["EngineStats", "LLM", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams", "Tokenizer"]
