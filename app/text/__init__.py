"""Tokenization for the light actors: encode, decode, chat templates, streaming detokenization.

Imports ``tokenizers`` and ``jinja2`` only, never torch or transformers, so the tokenizer and
detokenizer processes start in milliseconds (a test checks ``sys.modules``).
"""

from app.text.chat_template import ChatTemplate
from app.text.incremental_detokenize import IncrementalDetokenizer
from app.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "Tokenizer"]
