"""README's architecture table is the registry's (sluice.model.registry.architecture_table), and
every registered class loads."""

from __future__ import annotations

from pathlib import Path

from sluice.model.registry import _MODELS, architecture_table, get_model_class

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_table_is_generated_from_the_registry() -> None:
    text = README.read_text()
    start = text.index("<!-- architectures:")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end of architectures -->")
    assert text[start:end].strip() == architecture_table(), (
        "README's architecture table is stale: paste `python -m sluice.model.registry`")


def test_every_registered_architecture_has_its_class() -> None:
    for arch, (_, class_name, _) in _MODELS.items():
        assert get_model_class([arch]).__name__ == class_name
