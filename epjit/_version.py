"""The version of epjit, written in this one place (pyproject.toml reads it; the JIT cache is keyed by it)."""

__version__ = "0.1.0"
