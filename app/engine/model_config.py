"""A Hugging Face ``config.json``, parsed once into a frozen, validated description of the model.

This module imports no torch, so light processes (the tokenizer actor, the CLI) can read a model's
shape cheaply. Every problem is a ``ValueError`` that names ``config.json`` and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Mapping

CONFIG_FILE = "config.json"


@dataclass(frozen=True, slots=True)
class _ArchTraits:
    """What differs between the supported architectures; everything else is the shared decoder."""

    family: str
    # q/k/v projections carry a bias: always (Qwen2), or only when config says attention_bias.
    qkv_bias: Literal["always", "config"]
    # o_proj carries a bias when config says attention_bias (Llama, Qwen3), never for Qwen2.
    o_bias: Literal["never", "config"]
    qk_norm: bool  # per-head RMSNorm of q and k before rotary (Qwen3)


# Immutable on purpose: the single source of the supported architectures (no torch needed here).
ARCHITECTURES: Mapping[str, _ArchTraits] = MappingProxyType(
    {
        "LlamaForCausalLM": _ArchTraits("llama", "config", "config", qk_norm=False),
        "MistralForCausalLM": _ArchTraits("llama", "config", "config", qk_norm=False),
        "Qwen2ForCausalLM": _ArchTraits("qwen2", "always", "never", qk_norm=False),
        "Qwen3ForCausalLM": _ArchTraits("qwen3", "config", "config", qk_norm=True),
    }
)

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """Rotary frequency scaling. ``linear`` divides positions by ``factor``; ``llama3`` rescales
    low frequencies by ``factor`` and blends the band between ``high_freq_factor`` and
    ``low_freq_factor`` (wavelengths measured against ``original_max_position_embeddings``)."""

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """The shape and numerics of a supported decoder-only model."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in config.json (Qwen3) or hidden_size // num_heads
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain rotary
    max_position_embeddings: int
    # Mistral's sliding window; we attend over the full context, which is exact only up to it.
    sliding_window: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    dtype: str  # the checkpoint's dtype name, one of DTYPES

    @property
    def max_context_len(self) -> int:
        """Longest sequence this model serves exactly (full attention within any sliding window)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json``; raise FileNotFoundError or ValueError naming it."""
        path = Path(model_dir) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no {CONFIG_FILE} in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = CONFIG_FILE) -> ModelConfig:
        """Parse and validate an already loaded ``config.json``; ``source`` names it in errors."""
        return _Parser(raw, source).parse()


class _Parser:
    """Field readers that turn every mistake into one ValueError naming the file and the field."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.source = source

    def error(self, field: str, message: str) -> ValueError:
        return ValueError(f"{self.source}: {field}: {message}")

    def int_field(self, field: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.raw.get(field)
        value = default if value is None else value  # JSON null counts as absent
        if value is None:
            raise self.error(field, "missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.error(field, f"must be >= {minimum}, got {value}")
        return value

    def float_field(self, field: str, default: float | None = None, *, container: Mapping[str, Any] | None = None) -> float:
        value = (self.raw if container is None else container).get(field)
        value = default if value is None else value
        if value is None:
            raise self.error(field, "missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.error(field, f"expected a positive number, got {value!r}")
        return float(value)

    def bool_field(self, field: str, default: bool) -> bool:
        value = self.raw.get(field, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, f"expected true or false, got {value!r}")
        return value

    def parse(self) -> ModelConfig:
        architecture = self.architecture()
        traits = ARCHITECTURES[architecture]
        hidden_size = self.int_field("hidden_size")
        num_heads = self.int_field("num_attention_heads")
        num_kv_heads = self.int_field("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise self.error(
                "num_key_value_heads", f"{num_kv_heads} does not divide num_attention_heads={num_heads}"
            )
        if self.raw.get("head_dim") is not None:
            head_dim = self.int_field("head_dim")
        elif hidden_size % num_heads:
            raise self.error("hidden_size", f"{hidden_size} is not a multiple of num_attention_heads={num_heads}")
        else:
            head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise self.error("head_dim", f"rotary embedding needs an even head_dim, got {head_dim}")
        if self.raw.get("hidden_act", "silu") != "silu":
            raise self.error("hidden_act", f"only 'silu' is supported, got {self.raw['hidden_act']!r}")
        if self.bool_field("mlp_bias", False):
            raise self.error("mlp_bias", "MLP biases are not supported")
        attention_bias = self.bool_field("attention_bias", False)
        rope_theta, rope_scaling = self.rope()
        return ModelConfig(
            architecture=architecture,
            hidden_size=hidden_size,
            num_layers=self.int_field("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=self.int_field("intermediate_size"),
            vocab_size=self.int_field("vocab_size"),
            rms_norm_eps=self.float_field("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=self.int_field("max_position_embeddings"),
            sliding_window=self.sliding_window(traits.family),
            tie_word_embeddings=self.bool_field("tie_word_embeddings", False),
            qkv_bias=traits.qkv_bias == "always" or attention_bias,
            o_bias=traits.o_bias == "config" and attention_bias,
            qk_norm=traits.qk_norm,
            dtype=self.dtype(),
        )

    def architecture(self) -> str:
        archs = self.raw.get("architectures")
        supported = ", ".join(ARCHITECTURES)
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
            raise self.error("architectures", f"expected a list of one name, got {archs!r}; supported: {supported}")
        if archs[0] not in ARCHITECTURES:
            raise self.error("architectures", f"unsupported architecture {archs[0]!r}; supported: {supported}")
        return archs[0]

    def rope(self) -> tuple[float, RopeScaling | None]:
        """transformers 5 keeps theta and scaling in ``rope_parameters``; 4.x used ``rope_theta``
        plus ``rope_scaling`` (with ``type`` as an old alias of ``rope_type``)."""
        params = self.raw.get("rope_parameters")
        field = "rope_parameters"
        if params is None:
            params, field = self.raw.get("rope_scaling"), "rope_scaling"
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise self.error(field, f"expected an object, got {params!r}")
        if params and all(isinstance(v, Mapping) for v in params.values()):
            raise self.error(field, "per-layer-type rotary parameters are not supported")
        theta_source = params if "rope_theta" in params else self.raw
        theta = self.float_field("rope_theta", 10000.0, container=theta_source)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return theta, None
        if rope_type not in ("linear", "llama3"):
            raise self.error(field, f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
        factor = self.float_field("factor", container=params)
        if rope_type == "linear":
            return theta, RopeScaling(rope_type="linear", factor=factor)
        low = self.float_field("low_freq_factor", container=params)
        high = self.float_field("high_freq_factor", container=params)
        if high <= low:
            raise self.error(field, f"high_freq_factor {high} must exceed low_freq_factor {low}")
        original = params.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise self.error(field, f"original_max_position_embeddings: expected a positive integer, got {original!r}")
        return theta, RopeScaling(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )

    def sliding_window(self, family: str) -> int | None:
        """Qwen2/3 configs carry ``sliding_window`` even when ``use_sliding_window`` is off."""
        if family == "llama":
            value = self.raw.get("sliding_window")
            return None if value is None else self.int_field("sliding_window")
        if self.bool_field("use_sliding_window", False):
            raise self.error("use_sliding_window", "sliding-window attention is not supported")
        return None

    def dtype(self) -> str:
        # transformers 5 writes "dtype"; 4.x wrote "torch_dtype".
        field = "dtype" if self.raw.get("dtype") is not None else "torch_dtype"
        value = self.raw.get(field) or "float32"
        if value not in DTYPES:
            raise self.error(field, f"unsupported dtype {value!r}; supported: {', '.join(DTYPES)}")
        return value
