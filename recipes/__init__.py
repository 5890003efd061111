"""Model families: one recipe module each, registered under the exact HF architecture name.

The registry is generated from the recipe classes; a family with no tiny test model fails the registry test.
"""
from __future__ import annotations

from engine.core.errors import EngineError

from .base import Recipe
from .gemma2 import Gemma2Recipe
from .gemma3 import Gemma3Recipe
from .llama import LlamaRecipe
from .mistral import MistralRecipe
from .mixtral import MixtralRecipe
from .phi3 import Phi3Recipe
from .qwen2 import Qwen2Recipe
from .qwen2_moe import Qwen2MoeRecipe
from .qwen3 import Qwen3Recipe
from .qwen3_moe import Qwen3MoeRecipe

RECIPES: dict[str, type[Recipe]] = {r.architecture: r for r in (
    LlamaRecipe, MistralRecipe, Qwen2Recipe, Qwen3Recipe, Gemma2Recipe, Gemma3Recipe, Phi3Recipe,
    MixtralRecipe, Qwen2MoeRecipe, Qwen3MoeRecipe)}


def recipe_for(hf_config: dict) -> Recipe:
    archs = hf_config.get("architectures") or []
    if len(archs) != 1:
        raise EngineError(f"config.json names architectures {archs!r}; expected exactly one of: "
                          f"{', '.join(sorted(RECIPES))}")
    arch = archs[0]
    if arch not in RECIPES:
        raise EngineError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(RECIPES))}")
    return RECIPES[arch](hf_config)
