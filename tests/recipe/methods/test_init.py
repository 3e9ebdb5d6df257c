"""Tests of wandistiller/recipe/methods/__init__.py: the registry's hand-down of each method's model-card phrase."""

from __future__ import annotations

from wandistiller.recipe.methods import REGISTRY, card_phrases
from wandistiller.recipe.methods.base import Method


def test_card_phrases_are_each_registered_methods_own():
    phrases = card_phrases()
    assert list(phrases) == list(REGISTRY.names())
    for name, phrase in phrases.items():
        assert phrase == REGISTRY.get(name).cls.card_phrase and phrase != Method.card_phrase  # none left generic
        assert phrase.format(k=4, g=5.0, name=name)  # its placeholders are the card's
