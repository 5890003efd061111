"""Every registered family, through `engine convert`, against transformers.

- Weights: every tiny model of TINY_CONFIGS converted at tp 1, 2, 4 (and bfloat16), the ranks merged back, equal
  bit for bit to the HF tensors under an HF -> canonical table written here from the transformers modeling code
  (independently of the recipes' own tables; Phi-3's fused tensors split as Phi3Attention / Phi3MLP slice them).
- Semantics: the ModelConfig a recipe derives is checked against the live transformers module it describes
  (attention scaling, per-layer sliding window and rotary frequencies, norm formula, activation, embedding scale,
  soft-caps, tying), for the tiny models and for hub-style configs that omit keys, so family defaults are used.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine.core.artifacts import load_checkpoint_config
from engine.core.errors import EngineError
from engine.core.parallel import valid_tp_sizes
from engine.core.sharding import unpack_and_merge
from engine.recipes import recipe_for
from engine.recipes.convert import TORCH_DTYPES, ConvertConfig, convert
from engine.recipes.sources import HFDirSource
from tests.tiny_models import TINY_CONFIGS, architecture, make_tiny_model

KEYS = sorted(TINY_CONFIGS)
SANDWICH = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}  # post_attention_layernorm acts on the attention output
ONE_MASK = {"MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"}  # their attention keeps no window itself
_L = r"model\.layers\.(\d+)\."
HF_TO_CANONICAL = [  # (HF name, canonical name template; {0} = layer, {1} = part, {2} = weight|bias)
    (r"model\.embed_tokens\.weight", "vocab_embedding.weight"),
    (r"model\.norm\.weight", "final_norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (_L + r"input_layernorm\.weight", "layers.{0}.attn_norm.weight"),
    (_L + r"self_attn\.([qkv])_proj\.(weight|bias)", "layers.{0}.attention.{1}.{2}"),
    (_L + r"self_attn\.([qk])_norm\.(weight)", "layers.{0}.attention.{1}_norm.{2}"),
    (_L + r"self_attn\.o_proj\.weight", "layers.{0}.attention.dense.weight"),
    (_L + r"mlp\.(gate|up|down)_proj\.(weight)", "layers.{0}.mlp.{1}.{2}"),
    (_L + r"pre_feedforward_layernorm\.weight", "layers.{0}.mlp_norm.weight"),
    (_L + r"post_feedforward_layernorm\.weight", "layers.{0}.mlp_post_norm.weight"),
    # mixture of experts: the router (Mixtral's block_sparse_moe.gate), Qwen2-MoE's shared expert and its gate
    (_L + r"(?:mlp|block_sparse_moe)\.gate\.weight", "layers.{0}.moe.router.weight"),
    (_L + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", "layers.{0}.moe.shared.{1}.weight"),
    (_L + r"mlp\.shared_expert_gate\.weight", "layers.{0}.moe.shared_gate.weight"),
]
# one expert's projection (Mixtral: MixtralExperts' w1 gate, w3 up, w2 down) -> stacked on axis 0 by expert index
EXPERT = re.compile(_L + r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """key -> directory of the saved tiny model, made once per session."""
    made = {}

    def get(key):
        if key not in made:
            made[key] = make_tiny_model(key, tmp_path_factory.mktemp(key.replace(":", "-")))
        return made[key]
    return get


@pytest.fixture(scope="session")
def hf_model(tiny):
    from transformers import AutoModelForCausalLM
    loaded = {}

    def get(key):
        if key not in loaded:
            loaded[key] = AutoModelForCausalLM.from_pretrained(tiny(key), dtype=torch.float32).eval()
        return loaded[key]
    return get


def expected_logical(arch: str, hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """HF tensors under canonical logical names, per the transformers modeling code."""
    out, experts = {}, {}
    for name, t in hf.items():
        m = EXPERT.fullmatch(name)
        if m:
            experts.setdefault(f"layers.{m[1]}.moe.experts.{EXPERT_PART[m[3]]}.weight", {})[int(m[2])] = t
            continue
        if arch == "Phi3ForCausalLM" and name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            i = name.split(".")[2]
            if "qkv_proj" in name:  # Phi3Attention: query_pos = heads * head_dim, then kv_heads * head_dim each
                hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
                parts = dict(zip("qkv", (t[:q], t[q:q + kv], t[q + kv:])))
                out.update({f"layers.{i}.attention.{p}.weight": x for p, x in parts.items()})
            else:  # Phi3MLP: gate, up = gate_up_proj(x).chunk(2, dim=-1)
                gate, up = t.chunk(2, dim=0)
                out.update({f"layers.{i}.mlp.gate.weight": gate, f"layers.{i}.mlp.up.weight": up})
            continue
        m = re.fullmatch(_L + r"post_attention_layernorm\.weight", name)
        if m:
            out[f"layers.{m[1]}.{'attn_post_norm' if arch in SANDWICH else 'mlp_norm'}.weight"] = t
            continue
        for pattern, template in HF_TO_CANONICAL:
            m = re.fullmatch(pattern, name)
            if m:
                out[template.format(*m.groups())] = t
                break
        else:
            raise AssertionError(f"the test's table does not know {name}")
    for name, by_expert in experts.items():
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


@pytest.mark.parametrize("tp,dtype", [(1, "auto"), (2, "auto"), (4, "auto"), (2, "bfloat16")])
@pytest.mark.parametrize("key", KEYS)
def test_convert_matches_hf_weights(key, tp, dtype, tiny, tmp_path):
    src = tiny(key)
    hf_config = json.loads((src / "config.json").read_text())
    model = recipe_for(hf_config).model_config()
    if tp not in valid_tp_sizes(model):
        pytest.skip(f"tp {tp} cannot split {key}")
    out = tmp_path / "ckpt"
    ckpt = convert(HFDirSource(src), ConvertConfig(output_dir=out, tp=tp, dtype=dtype))

    want_dtype = "float32" if dtype == "auto" else dtype  # the tiny models are saved in float32
    assert load_checkpoint_config(out) == ckpt
    assert (ckpt.dtype, ckpt.architecture) == (want_dtype, architecture(key))
    assert (ckpt.mapping.tp_size, ckpt.mapping.world_size, ckpt.mapping.pp_size) == (tp, tp, 1)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()

    ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in range(tp)]
    assert sorted(p.name for p in out.glob("rank*")) == [f"rank{r}.safetensors" for r in range(tp)]
    assert all(t.dtype == TORCH_DTYPES[want_dtype] for r in ranks for t in r.values())
    assert all(set(r) == set(ranks[0]) for r in ranks)
    merged = unpack_and_merge(ranks, ckpt.model)

    from transformers import AutoConfig
    hf = load_file(str(src / "model.safetensors"))
    expected = expected_logical(architecture(key), hf, AutoConfig.from_pretrained(src))
    if ckpt.model.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        if tp > 1:  # vocab-parallel lm_head needs its own shards of the tied embedding
            expected["lm_head.weight"] = expected["vocab_embedding.weight"]
    assert sorted(merged) == sorted(expected)
    for name, want in expected.items():
        assert torch.equal(merged[name], want.to(TORCH_DTYPES[want_dtype])), name


def test_tp_that_cannot_split_the_heads_is_refused(tiny, tmp_path):
    src = tiny("MistralForCausalLM")  # 4 heads, 2 KV heads
    with pytest.raises(EngineError, match=r"--tp 3 .*num_heads 4 is not divisible by 3.*work for this model: 1, 2, 4"):
        convert(HFDirSource(src), ConvertConfig(output_dir=tmp_path / "ckpt", tp=3))
    assert not (tmp_path / "ckpt").exists()


def check_moe_against_hf(cfg, hf) -> None:
    """MoeConfig against the sparse blocks transformers built: which layers, sizes, top-k and its normalization."""
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] == sparse
    if not sparse:
        assert cfg.moe is None
        return
    block = hf.model.layers[sparse[0]].mlp
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k) == (block.experts.num_experts, block.gate.top_k)
    assert moe.intermediate_size == block.experts.intermediate_dim
    # Mixtral's router always divides the top-k by their sum (MixtralTopKRouter.forward); Qwen's iff norm_topk_prob
    assert moe.normalize_top_k == getattr(block.gate, "norm_topk_prob", True)
    shared = getattr(block, "shared_expert", None)
    assert moe.shared_intermediate_size == (shared.down_proj.in_features if shared is not None else 0)
    assert moe.shared_gate == hasattr(block, "shared_expert_gate")


# ---- semantics against the transformers modules ------------------------------------------------------------------

def _inv_freq(rope, head_dim: int) -> torch.Tensor:
    """Frequencies of our RopeConfig as transformers' own rope functions compute them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    params = {"rope_type": rope.type, "rope_theta": rope.theta}
    if rope.type in ("linear", "llama3"):
        params["factor"] = rope.factor
    if rope.type == "llama3":
        params.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                      original_max_position_embeddings=rope.original_max_positions)
    cfg = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, rope_parameters=params)
    emb = LlamaRotaryEmbedding(cfg)
    assert emb.attention_scaling == 1.0
    return emb.inv_freq


def check_against_hf(cfg, hf) -> None:
    """Every ModelConfig field against what the transformers model `hf` computes."""
    arch = type(hf).__name__
    base, c = hf.model, hf.config
    layers = base.layers
    attn = layers[0].self_attn
    dense = [layer.mlp for layer in layers if not hasattr(layer.mlp, "experts")]
    mlp = dense[0] if dense else layers[0].mlp.experts   # the experts' activation when no layer is dense
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size) == tuple(base.embed_tokens.weight.shape)
    assert cfg.num_layers == len(layers)
    assert (cfg.num_heads, cfg.num_kv_heads) == (c.num_attention_heads, c.num_key_value_heads)
    assert cfg.head_dim == attn.head_dim
    if dense:
        assert cfg.intermediate_size == mlp.down_proj.in_features
    check_moe_against_hf(cfg, hf)
    assert cfg.max_position_embeddings == c.max_position_embeddings
    assert cfg.tie_word_embeddings == (hf.lm_head.weight.data_ptr() == base.embed_tokens.weight.data_ptr())
    assert cfg.qkv_bias == (getattr(attn, "q_proj", getattr(attn, "qkv_proj", None)).bias is not None)
    assert cfg.qk_norm == hasattr(attn, "q_norm")
    assert cfg.sandwich_norms == hasattr(layers[0], "post_feedforward_layernorm")
    assert (cfg.attention_scale or cfg.head_dim ** -0.5) == pytest.approx(attn.scaling, rel=1e-12)
    # Gemma3Attention keeps attn_logit_softcapping but never passes it to the attention function
    attn_cap = None if arch == "Gemma3ForCausalLM" else getattr(attn, "attn_logit_softcapping", None)
    assert cfg.attn_logit_softcap == attn_cap
    assert cfg.final_logit_softcap == getattr(c, "final_logit_softcapping", None)

    torch.manual_seed(1)
    with torch.no_grad():
        x = torch.randn(3, cfg.hidden_size) * 3
        norm = base.norm
        assert cfg.norm_eps == getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        x_head = torch.randn(3, cfg.head_dim)
        for module, v in [(norm, x)] + ([(attn.q_norm, x_head), (attn.k_norm, x_head)] if cfg.qk_norm else []):
            scale = cfg.norm_weight_offset + module.weight.float()
            ours = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * scale
            torch.testing.assert_close(module(v), ours, rtol=1e-6, atol=1e-6)
        ids = torch.tensor([[3, 7, 500]])
        torch.testing.assert_close(base.embed_tokens(ids), base.embed_tokens.weight[ids] * cfg.embedding_multiplier)
        act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
        ref = {"silu": torch.nn.functional.silu,
               "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[cfg.activation]
        torch.testing.assert_close(act(x), ref(x))

    for i, layer in enumerate(layers):
        sliding = cfg.layer_type(i) == "sliding"
        # Mistral, Phi3 and Mixtral apply config.sliding_window to every layer through one mask; the others per layer
        one_mask = c.sliding_window if arch in ONE_MASK else None
        hf_window = getattr(layer.self_attn, "sliding_window", one_mask)
        assert (cfg.sliding_window if sliding else None) == hf_window, f"layer {i}"
        rope = cfg.local_rope if sliding and cfg.local_rope else cfg.rope
        emb = base.rotary_emb
        hf_type = getattr(c, "layer_types", None)
        if hasattr(emb, "inv_freq"):
            hf_freq = emb.inv_freq
        else:  # Gemma3: one set of frequencies per layer type
            hf_freq = getattr(emb, f"{hf_type[i]}_inv_freq")
            assert getattr(emb, f"{hf_type[i]}_attention_scaling") == 1.0
        torch.testing.assert_close(_inv_freq(rope, cfg.head_dim), hf_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("key", KEYS)
def test_model_config_matches_hf(key, tiny, hf_model):
    cfg = recipe_for(json.loads((tiny(key) / "config.json").read_text())).model_config()
    check_against_hf(cfg, hf_model(key))


_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# config.json as hub checkpoints written by older transformers have them: keys omitted, legacy rope keys
LEGACY_CONFIGS = {
    "mistral-window-omitted": ("mistral", "MistralForCausalLM", dict(num_hidden_layers=2)),
    "qwen2-derived-layer-types": ("qwen2", "Qwen2ForCausalLM", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=2, rope_theta=5e5)),
    "qwen3-head-dim-omitted": ("qwen3", "Qwen3ForCausalLM", dict(num_hidden_layers=2)),
    "gemma2-defaults": ("gemma2", "Gemma2ForCausalLM", dict(num_hidden_layers=3, hidden_act="gelu")),
    "gemma3-legacy-rope": ("gemma3_text", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, sliding_window_pattern=3, rope_theta=5e5, rope_local_base_freq=2e4,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "phi3-eps-omitted": ("phi3", "Phi3ForCausalLM", dict(num_hidden_layers=2, rope_theta=2e4)),
    "mixtral-defaults": ("mixtral", "MixtralForCausalLM", dict(num_hidden_layers=2)),
    # hub configs name num_experts (transformers 5 writes num_local_experts); dense layers both ways, derived windows
    "qwen2-moe-dense-layers": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mlp_only_layers=[1], use_sliding_window=True, sliding_window=5,
        max_window_layers=3)),
    "qwen3-moe-sparse-step": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
        norm_topk_prob=True)),
}


@pytest.mark.parametrize("name", sorted(LEGACY_CONFIGS))
def test_family_defaults_match_hf(name):
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, arch, extra = LEGACY_CONFIGS[name]
    raw = {"architectures": [arch], "model_type": model_type, **_SMALL, **extra}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).eval()
    check_against_hf(recipe_for(raw).model_config(), hf)


# ---- what is refused -----------------------------------------------------------------------------------------------

def _edited(tiny, tmp_path, key, **changes):
    src = tmp_path / "model"
    shutil.copytree(tiny(key), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("key,changes,match", [
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1] * 8,
                                             "long_factor": [2] * 8, "original_max_position_embeddings": 64}},
     "rope type 'longrope' of this Phi3ForCausalLM model .* not supported"),
    ("Phi3ForCausalLM", {"rope_parameters": None, "rope_scaling": {"type": "su", "short_factor": [1] * 8}},
     "rope type 'su' of this Phi3ForCausalLM"),
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75 of this Phi3ForCausalLM model is not supported"),
    ("Qwen2ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": False},
     "sliding-window layers but no sliding_window"),
    ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias=true is not supported"),
    ("Gemma2ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation='relu' of this Gemma3ForCausalLM"),
    ("MistralForCausalLM", {"architectures": ["MistralModel"]},
     "architecture 'MistralModel' is not supported; supported: Gemma2ForCausalLM, .*Phi3ForCausalLM"),
])
def test_unsupported_configs_are_refused(key, changes, match, tiny, tmp_path):
    src = _edited(tiny, tmp_path, key, **changes)
    with pytest.raises(EngineError, match=match):
        convert(HFDirSource(src), ConvertConfig(output_dir=tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_fused_tensor_of_the_wrong_size_is_refused(tiny, tmp_path):
    src = _edited(tiny, tmp_path, "Phi3ForCausalLM", num_key_value_heads=4)  # the weights have 2 KV heads
    with pytest.raises(EngineError, match=r"qkv_proj.weight has 128 rows, config.json implies 192"):
        convert(HFDirSource(src), ConvertConfig(output_dir=tmp_path / "ckpt"))
