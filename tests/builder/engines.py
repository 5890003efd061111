"""Tiny models, checkpoints and engines made once per test session, and the transformers references.

    tiny = TinyEngines(root)
    tiny.engine("LlamaForCausalLM", plugins=False)   # HF dir -> convert -> build, each step cached under root
    tiny.hf_model("LlamaForCausalLM")                 # AutoModelForCausalLM, float32, eager attention
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.plugins import quant_matmul
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.sources import HFDirSource
from tests.tiny_models import TINY_CONFIGS, make_tiny_model

# Small limits with several blocks per sequence (4 tokens a block), so paging is exercised.
TEST_BUILD = BuildConfig(max_batch_size=8, max_input_len=64, max_seq_len=128, max_num_tokens=256, tokens_per_block=4)
ALL_PLUGINS = PluginConfig()
NO_PLUGINS = PluginConfig(gpt_attention_plugin=False, engine_kernels_plugin=False, rmsnorm_plugin=False,
                          rotary_plugin=False, gemm_swiglu_plugin=False)


def stored_float(init: onnx.TensorProto, n: int, base_dir: str | None = None) -> np.ndarray:
    """A float32 weight of N rows (out features) as an engine stores it, as [N, K]: QuantMatMul's float32 tiles where
    the build runs them (plugins/quant_matmul.pack_float), else the float32 tensor (Gemm's and Gather's [N, K],
    MatMul's [K, N])."""
    array = numpy_helper.to_array(init, base_dir=base_dir) if base_dir else numpy_helper.to_array(init)
    if init.data_type == onnx.TensorProto.UINT8:
        return quant_matmul.unpack_float(array, n)
    assert array.dtype == np.float32, init.name
    return array if array.shape[0] == n else array.T


def slug(key: str) -> str:
    return key.replace(":", "_")


class TinyEngines:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._models: dict[str, torch.nn.Module] = {}

    def hf_dir(self, key: str) -> Path:
        d = self.root / slug(key) / "hf"
        if not d.exists():
            make_tiny_model(key, d)
        return d

    def checkpoint(self, key: str, tp: int = 1) -> Path:
        d = self.root / slug(key) / f"ckpt_tp{tp}"
        if not d.exists():
            convert(HFDirSource(self.hf_dir(key)), ConvertConfig(output_dir=d, tp=tp))
        return d

    def engine(self, key: str, *, plugins: bool = True, **build) -> Path:
        b = dataclasses.replace(TEST_BUILD, **build)
        tag = "_".join(f"{k}{v}" for k, v in sorted(build.items()))
        d = self.root / slug(key) / f"engine_{'plugins' if plugins else 'reference'}{'_' + tag if tag else ''}"
        if not d.exists():
            build_engine(self.checkpoint(key), d, b, ALL_PLUGINS if plugins else NO_PLUGINS)
        return d

    def hf_model(self, key: str):
        if key not in self._models:
            from transformers import AutoModelForCausalLM
            self._models[key] = AutoModelForCausalLM.from_pretrained(
                self.hf_dir(key), dtype=torch.float32, attn_implementation="eager").eval()
        return self._models[key]


def prompts(count: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Random token ids in [3, vocab) (no special tokens), one prompt per length."""
    rng = np.random.default_rng(seed)
    vocab = TINY_CONFIGS["LlamaForCausalLM"]().vocab_size
    return [rng.integers(3, vocab, n).tolist() for n in lengths[:count]]


def hf_last_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float().numpy()


def hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy generate (its KV cache, no EOS stop): new tokens and their logits [steps, vocab]."""
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float().numpy()


def engine_greedy(session, ids: list[int], steps: int, blocks: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy decoding through the paged cache: one prefill, then one token per run(); tokens, logits."""
    from engine.runtime.step_inputs import SeqChunk
    logits = [session.run([SeqChunk(ids, 0, blocks, True)])[0]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < steps:
        logits.append(session.run([SeqChunk([tokens[-1]], len(ids) + len(tokens) - 1, blocks, True)])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, np.stack(logits)


def check_parity(session, model, key: str, *, steps: int, seed: int, decode_prompt: int) -> None:
    """Three prompts (shorter and longer than the tiny models' sliding window of 8, not block-aligned) prefilled in
    one step, each last-token logits vs transformers; then `steps` greedy tokens of one of them through the paged
    cache, logits and tokens vs transformers' greedy generate."""
    from engine.runtime.step_inputs import SeqChunk
    from tests.tolerances import assert_logits_close
    batch = prompts(3, (5, 13, 30), seed=seed)
    tables, next_block = [], 0
    for ids in batch:
        n = -(-len(ids) // session.config.build.tokens_per_block)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    logits = session.run([SeqChunk(ids, 0, table, True) for ids, table in zip(batch, tables)])
    for row, ids in zip(logits, batch):
        assert_logits_close(row, hf_last_logits(model, ids), what=f"{key} prefill of {len(ids)} tokens")
    ids = batch[decode_prompt]
    blocks = list(range(40, 40 + -(-(len(ids) + steps) // session.config.build.tokens_per_block)))
    tokens, engine_logits = engine_greedy(session, ids, steps, blocks)
    ref_tokens, ref_logits = hf_greedy(model, ids, steps)
    assert_logits_close(engine_logits, ref_logits, what=f"{key} greedy decode logits")
    assert tokens == ref_tokens
