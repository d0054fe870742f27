"""app: an LLM serving runtime built as supervised trio actors over shared-memory channels."""

__version__ = "0.1.0"
