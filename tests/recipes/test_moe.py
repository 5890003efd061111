"""The mixture-of-experts recipes' tensors: transformers 5's stacked expert layout converts to the same checkpoint as
the per-expert one, and missing, extra or mismatched experts are refused naming them."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.errors import EngineError
from engine.core.model_config import MoeConfig
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.sources import HFDirSource
from tests.tiny_models import make_tiny_model

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_model("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen3_moe"))


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / WEIGHTS)
    edit(tensors)
    save_file(tensors, dst / WEIGHTS)
    return dst


def _stacked_layout(tensors: dict) -> None:
    """Per-expert tensors -> transformers 5's Qwen3MoeExperts parameters: gate_up_proj [E, 2I, H] (each expert's
    gate rows, then its up rows) and down_proj [E, H, I]."""
    layers = {int(name.split(".")[2]) for name in tensors if ".experts." in name}
    for i in layers:
        p = f"model.layers.{i}.mlp.experts."
        count = len([n for n in tensors if n.startswith(p) and n.endswith("down_proj.weight")])
        take = lambda what: [tensors.pop(f"{p}{e}.{what}.weight") for e in range(count)]  # noqa: E731
        gate, up, down = take("gate_proj"), take("up_proj"), take("down_proj")
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[p + "down_proj"] = torch.stack(down)


def test_stacked_expert_layout_converts_to_the_same_checkpoint(qwen3_moe, tmp_path):
    convert(HFDirSource(qwen3_moe), ConvertConfig(output_dir=tmp_path / "per_expert", tp=2))
    stacked = _edited(qwen3_moe, tmp_path / "stacked_hf", _stacked_layout)
    assert any(name.endswith("experts.gate_up_proj") for name in load_file(stacked / WEIGHTS))
    convert(HFDirSource(stacked), ConvertConfig(output_dir=tmp_path / "stacked", tp=2))
    for rank in range(2):
        want = load_file(tmp_path / "per_expert" / f"rank{rank}.safetensors")
        got = load_file(tmp_path / "stacked" / f"rank{rank}.safetensors")
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_missing_expert_is_refused(qwen3_moe, tmp_path):
    src = _edited(qwen3_moe, tmp_path / "hf", lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(EngineError, match=r"lacks weights .*layers\.1\.moe\.experts\.up\.weight"):
        convert(HFDirSource(src), ConvertConfig(output_dir=tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_an_expert_beyond_the_config_is_refused(qwen3_moe, tmp_path):
    def extra(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = t["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    src = _edited(qwen3_moe, tmp_path / "hf", extra)
    with pytest.raises(EngineError, match=r"experts\.8\.up_proj\.weight is of expert 8, but config.json gives the "
                                          r"model 8 experts"):
        convert(HFDirSource(src), ConvertConfig(output_dir=tmp_path / "ckpt"))


def test_experts_of_another_size_are_refused(qwen3_moe, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(qwen3_moe, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 16}))
    # named by the last expert's tensor, which completes the stack
    with pytest.raises(EngineError, match=r"experts\.7\.\w+_proj\.weight has shape \[8, \d+, \d+\], but config"):
        convert(HFDirSource(src), ConvertConfig(output_dir=tmp_path / "ckpt"))


@pytest.mark.parametrize("fields,match", [
    (dict(num_experts=4, top_k=5, intermediate_size=8), "top_k 5 experts per token"),
    (dict(num_experts=4, top_k=2, intermediate_size=8, shared_gate=True), "shared-expert gate needs a shared"),
])
def test_impossible_moe_configs_are_refused(fields, match):
    with pytest.raises(EngineError, match=match):
        MoeConfig(**fields)
