"""The registry of families and the tiny test models cover each other (vLLM's registry test): a registered
architecture without a tiny model is untested, and a tiny model of an unregistered architecture tests nothing.
"""
from __future__ import annotations

import pytest

from engine.core.errors import EngineError
from engine.recipes import RECIPES, recipe_for
from tests.tiny_models import TINY_CONFIGS, architecture


def test_every_registered_family_has_a_tiny_model():
    tested = {architecture(key) for key in TINY_CONFIGS}
    missing = sorted(set(RECIPES) - tested)
    assert not missing, f"registered families without a tiny test model in tests/tiny_models.py: {missing}"


def test_every_tiny_model_is_of_a_registered_family():
    unregistered = sorted({architecture(key) for key in TINY_CONFIGS} - set(RECIPES))
    assert not unregistered, f"tiny models of architectures no recipe registers: {unregistered}"


@pytest.mark.parametrize("key", sorted(TINY_CONFIGS))
def test_tiny_model_builds_the_architecture_of_its_key(key):
    """The key's architecture is what transformers instantiates for its config (and writes to config.json)."""
    from transformers import AutoModelForCausalLM
    config = TINY_CONFIGS[key]()
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    assert cls.__name__ == architecture(key)


def test_registry_keys_are_the_recipes_architectures():
    assert all(name == recipe.architecture for name, recipe in RECIPES.items())
    assert len({recipe for recipe in RECIPES.values()}) == len(RECIPES)


@pytest.mark.parametrize("archs", [["NoSuchForCausalLM"], [], ["LlamaForCausalLM", "MistralForCausalLM"]])
def test_unknown_architecture_names_the_supported_ones(archs):
    with pytest.raises(EngineError) as e:
        recipe_for({"architectures": archs})
    assert all(name in str(e.value) for name in RECIPES)
