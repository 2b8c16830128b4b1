"""The version of sluice (also in pyproject.toml)."""

__version__ = "0.1.0"
