"""Random-weight Hugging Face checkpoints: the embedded tiny model, and real shapes for benchmarks.

``python -m app serve`` must work offline on a fresh machine, so ``default_model_dir()`` builds a
tiny Llama in the cache directory on first use (a second or two) and reuses it afterwards. The
same writer, through ``tools/make_model.py``, makes checkpoints with the exact shapes of real
models (``PRESETS``) for GPU benchmarks; their output is gibberish, their cost is real.

Every byte is deterministic: each tensor is drawn from its own generator, seeded from the spec's
seed and the tensor's name, so the same spec gives the same files whatever the sharding, and the
weights of a float32 and a bfloat16 build differ only by rounding.

Memory stays bounded for 8B models: safetensors files are written by hand, header first (the
shapes are known in advance), then each tensor streamed in chunks of a few MB, so no more than one
chunk is ever in memory. torch is imported only to draw the numbers, when a checkpoint is written,
so resolving ``default_model_dir()`` once it exists costs no torch import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from app.text import builtin_tokenizer as builtin

if TYPE_CHECKING:
    import torch

ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
)  # architecture -> config.json model_type

# dtype name -> (safetensors dtype code, bytes per element)
DTYPES: Mapping[str, tuple[str, int]] = MappingProxyType(
    {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}
)

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes; what transformers' save_pretrained used for years
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = ".app-manifest.json"  # written last: file sizes, proof that the build finished
NORM_STD = 0.1  # norm weights are 1 + N(0, NORM_STD): not all ones, so a skipped norm weight shows
_CHUNK_ELEMENTS = 1 << 22  # numbers drawn per step while streaming a tensor (16 MiB of float32)
_MANIFEST_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3's rotary scaling (``rope_type: llama3``): long wavelengths are stretched by
    ``factor``, short ones kept, the band between blended."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_config(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "high_freq_factor": self.high_freq_factor,
            "low_freq_factor": self.low_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "rope_type": "llama3",
        }


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What to build: the shape of the model, its numerics, the dtype of the files and the seed."""

    architecture: str = "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None: hidden_size // num_heads (see resolved_head_dim)
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    seed: int = 0
    init_std: float = 0.02  # std of weights and biases; small, as in real initialisations

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"head_dim: hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                             "give head_dim explicitly")
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int)
                                          or self.head_dim < 2):
            raise ValueError(f"head_dim: expected an integer >= 2, got {self.head_dim!r}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim: rotary embedding needs an even head_dim, got {self.resolved_head_dim}")
        if self.architecture == "Qwen2ForCausalLM" and self.resolved_head_dim * self.num_heads != self.hidden_size:
            raise ValueError("head_dim: Qwen2 requires head_dim * num_heads == hidden_size")
        if self.vocab_size < builtin.VOCAB_SIZE:
            raise ValueError(f"vocab_size: {self.vocab_size} is smaller than the built-in tokenizer's {builtin.VOCAB_SIZE}")
        for name in ("rope_theta", "rms_norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected a non-negative integer, got {self.seed!r}")
        scaling = self.rope_scaling
        if scaling is not None:
            if not scaling.factor >= 1.0:
                raise ValueError(f"rope_scaling.factor: expected >= 1, got {scaling.factor}")
            if not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
                raise ValueError("rope_scaling: need 0 < low_freq_factor < high_freq_factor")
            if not 1 <= scaling.original_max_position_embeddings <= self.max_position_embeddings:
                raise ValueError("rope_scaling.original_max_position_embeddings: must be in [1, max_position_embeddings]")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def replace(self, **changes: Any) -> ModelSpec:
        """A validated copy with some fields changed (e.g. a preset with fewer layers)."""
        return dataclasses.replace(self, **changes)


# The embedded model: small enough for fast CPU tests, shaped like Llama 3 (GQA, llama3 rope
# scaling whose three frequency bands all occur at head_dim 32), vocabulary = the tokenizer's.
TINY_LLAMA = ModelSpec(
    architecture="LlamaForCausalLM", num_layers=4, hidden_size=128, intermediate_size=384,
    num_heads=4, num_kv_heads=2, vocab_size=builtin.VOCAB_SIZE, max_position_embeddings=4096,
    rope_theta=500000.0, rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=1024),
    rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="float32",
)

_LLAMA3_RS_8B = Llama3RopeScaling(factor=8.0)
_LLAMA3_RS_32 = Llama3RopeScaling(factor=32.0)

# Shapes copied from the real models' config.json files; only the weights (and the tokenizer,
# whose ids fit in every vocabulary here) are ours.
PRESETS: Mapping[str, ModelSpec] = MappingProxyType({
    "tiny-llama": TINY_LLAMA,
    # Tiny Qwen2: q/k/v biases, tied embeddings and a vocabulary padded past the tokenizer's, as Qwen2.5 has.
    "tiny-qwen2": ModelSpec(
        architecture="Qwen2ForCausalLM", num_layers=4, hidden_size=128, intermediate_size=384, num_heads=4,
        num_kv_heads=2, vocab_size=builtin.VOCAB_SIZE + 64, max_position_embeddings=4096, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32"),
    # Tiny Qwen3: q/k norms, and head_dim * num_heads != hidden_size, as in Qwen3-0.6B.
    "tiny-qwen3": ModelSpec(
        architecture="Qwen3ForCausalLM", num_layers=4, hidden_size=128, intermediate_size=384, num_heads=4,
        num_kv_heads=2, head_dim=64, vocab_size=builtin.VOCAB_SIZE, max_position_embeddings=4096,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32"),
    "llama-3.2-1b": ModelSpec(
        architecture="LlamaForCausalLM", num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32,
        num_kv_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_RS_32, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-3b": ModelSpec(
        architecture="LlamaForCausalLM", num_layers=28, hidden_size=3072, intermediate_size=8192, num_heads=24,
        num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_RS_32, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.1-8b": ModelSpec(
        architecture="LlamaForCausalLM", num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
        num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_RS_8B, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-0.5b": ModelSpec(
        architecture="Qwen2ForCausalLM", num_layers=24, hidden_size=896, intermediate_size=4864, num_heads=14,
        num_kv_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
    "qwen2.5-7b": ModelSpec(
        architecture="Qwen2ForCausalLM", num_layers=28, hidden_size=3584, intermediate_size=18944, num_heads=28,
        num_kv_heads=4, vocab_size=152064, max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
    "qwen3-0.6b": ModelSpec(
        architecture="Qwen3ForCausalLM", num_layers=28, hidden_size=1024, intermediate_size=3072, num_heads=16,
        num_kv_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-8b": ModelSpec(
        architecture="Qwen3ForCausalLM", num_layers=36, hidden_size=4096, intermediate_size=12288, num_heads=32,
        num_kv_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False),
})


# ---------------------------------------------------------------- the tensor plan (no torch)


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    # How it is filled: "weight" and "bias" ~ N(0, init_std), "norm" ~ 1 + N(0, NORM_STD).
    init: Literal["weight", "bias", "norm"]


class ShardPlan(NamedTuple):
    filename: str
    tensors: tuple[TensorSpec, ...]
    nbytes: int  # tensor data only, without the safetensors header


class CheckpointPlan(NamedTuple):
    """Which tensors go to which file: everything about the weights except their values."""

    shards: tuple[ShardPlan, ...]
    total_size: int  # bytes of tensor data, as model.safetensors.index.json reports it
    num_parameters: int


def tensor_specs(spec: ModelSpec) -> list[TensorSpec]:
    """Every tensor of the checkpoint, named as transformers names them, in file order."""
    h, d = spec.hidden_size, spec.resolved_head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    tensors = [TensorSpec("model.embed_tokens.weight", (spec.vocab_size, h), "weight")]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors.append(TensorSpec(p + "input_layernorm.weight", (h,), "norm"))
        tensors.append(TensorSpec(p + "self_attn.q_proj.weight", (q, h), "weight"))
        tensors.append(TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "weight"))
        tensors.append(TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "weight"))
        if spec.architecture == "Qwen2ForCausalLM":
            tensors.append(TensorSpec(p + "self_attn.q_proj.bias", (q,), "bias"))
            tensors.append(TensorSpec(p + "self_attn.k_proj.bias", (kv,), "bias"))
            tensors.append(TensorSpec(p + "self_attn.v_proj.bias", (kv,), "bias"))
        if spec.architecture == "Qwen3ForCausalLM":
            tensors.append(TensorSpec(p + "self_attn.q_norm.weight", (d,), "norm"))
            tensors.append(TensorSpec(p + "self_attn.k_norm.weight", (d,), "norm"))
        tensors.append(TensorSpec(p + "self_attn.o_proj.weight", (h, q), "weight"))
        tensors.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"))
        tensors.append(TensorSpec(p + "mlp.gate_proj.weight", (spec.intermediate_size, h), "weight"))
        tensors.append(TensorSpec(p + "mlp.up_proj.weight", (spec.intermediate_size, h), "weight"))
        tensors.append(TensorSpec(p + "mlp.down_proj.weight", (h, spec.intermediate_size), "weight"))
    tensors.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not spec.tie_word_embeddings:
        tensors.append(TensorSpec("lm_head.weight", (spec.vocab_size, h), "weight"))
    return tensors


def plan_checkpoint(spec: ModelSpec, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> CheckpointPlan:
    """Split the tensors into files of at most ``max_shard_size`` bytes (a bigger tensor gets a
    file of its own), named as transformers names them."""
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"max_shard_size: expected a positive number of bytes, got {max_shard_size!r}")
    itemsize = DTYPES[spec.dtype][1]
    groups: list[list[TensorSpec]] = [[]]
    sizes = [0]
    for tensor in tensor_specs(spec):
        nbytes = math.prod(tensor.shape) * itemsize
        if groups[-1] and sizes[-1] + nbytes > max_shard_size:
            groups.append([])
            sizes.append(0)
        groups[-1].append(tensor)
        sizes[-1] += nbytes
    count = len(groups)
    names = [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    shards = tuple(ShardPlan(name, tuple(group), size) for name, group, size in zip(names, groups, sizes))
    num_parameters = sum(math.prod(t.shape) for group in groups for t in group)
    return CheckpointPlan(shards, sum(sizes), num_parameters)


# ---------------------------------------------------------------- config files


def model_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json, in the form the real checkpoints on the Hub have (``rope_theta`` and
    ``rope_scaling``, ``torch_dtype``), which transformers 5 still reads."""
    eos_ids = [builtin.special_token_id(builtin.EOS_TOKEN), builtin.special_token_id(builtin.EOT_TOKEN)]
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": ARCHITECTURES[spec.architecture],
        "attention_dropout": 0.0,
        "bos_token_id": builtin.special_token_id(builtin.BOS_TOKEN),
        "eos_token_id": eos_ids,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": spec.rope_scaling.to_config() if spec.rope_scaling else None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    if spec.architecture == "LlamaForCausalLM":
        config.update(attention_bias=False, head_dim=spec.resolved_head_dim, mlp_bias=False, pretraining_tp=1)
    elif spec.architecture == "Qwen2ForCausalLM":
        config.update(max_window_layers=spec.num_layers, sliding_window=spec.max_position_embeddings,
                      use_sliding_window=False)
    else:
        config.update(attention_bias=False, head_dim=spec.resolved_head_dim, max_window_layers=spec.num_layers,
                      sliding_window=None, use_sliding_window=False)
    return config


def generation_config() -> dict[str, Any]:
    """generation_config.json: generation ends at <|end_of_text|> or at the end of a chat turn."""
    return {
        "bos_token_id": builtin.special_token_id(builtin.BOS_TOKEN),
        "eos_token_id": [builtin.special_token_id(builtin.EOS_TOKEN), builtin.special_token_id(builtin.EOT_TOKEN)],
        "pad_token_id": builtin.special_token_id(builtin.PAD_TOKEN),
    }


def _json_text(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------- writing


def make_checkpoint(
    out_dir: str | Path,
    spec: ModelSpec = TINY_LLAMA,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a complete checkpoint to ``out_dir`` (absent or empty) and return it.

    The files are written in a temporary sibling directory which is then renamed, so ``out_dir``
    either does not exist or is complete; on any error the temporary directory is removed.
    Raises FileExistsError if ``out_dir`` has content, ValueError for a bad ``max_shard_size``.
    ``progress`` receives one line per file written.
    """
    out_dir = Path(out_dir)
    plan = plan_checkpoint(spec, max_shard_size)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        _write_files(tmp, spec, plan, progress or (lambda line: None))
        os.chmod(tmp, 0o755)  # mkdtemp made it private
        os.rename(tmp, out_dir)  # atomic; replaces an empty directory, fails on a non-empty one
        _fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_files(directory: Path, spec: ModelSpec, plan: CheckpointPlan, progress: Callable[[str], None]) -> None:
    """Every file of the checkpoint, the manifest last (its presence means the rest is there)."""
    # transformers tokenizes every qwen2 checkpoint the Qwen way; see builtin_tokenizer.build_tokenizer.
    flavor = "qwen2" if spec.architecture == "Qwen2ForCausalLM" else "llama3"
    tokenizer = builtin.tokenizer_files(spec.max_position_embeddings, flavor)
    texts = {
        "config.json": _json_text(model_config(spec)),
        "generation_config.json": _json_text(generation_config()),
        "tokenizer.json": tokenizer.tokenizer_json,
        "tokenizer_config.json": _json_text(tokenizer.tokenizer_config),
        "special_tokens_map.json": _json_text(tokenizer.special_tokens_map),
        "chat_template.jinja": tokenizer.chat_template,
    }
    if len(plan.shards) > 1:
        weight_map = {t.name: shard.filename for shard in plan.shards for t in shard.tensors}
        texts[INDEX_FILE] = _json_text({"metadata": {"total_size": plan.total_size}, "weight_map": weight_map})
    for name, text in texts.items():
        _write_bytes(directory / name, text.encode("utf-8"))
    for shard in plan.shards:
        _write_safetensors(directory / shard.filename, shard, spec)
        progress(f"wrote {shard.filename} ({shard.nbytes / 1e9:.2f} GB, {len(shard.tensors)} tensors)")
    sizes = {path.name: path.stat().st_size for path in sorted(directory.iterdir())}
    manifest = {"format": _MANIFEST_FORMAT, "spec": dataclasses.asdict(spec), "files": sizes}
    _write_bytes(directory / MANIFEST_FILE, _json_text(manifest).encode("utf-8"))


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(path: Path, shard: ShardPlan, spec: ModelSpec) -> None:
    """One safetensors file, streamed.

    Layout: an 8-byte little-endian header length, the JSON header (padded with spaces to a
    multiple of 8 so the data is aligned), then each tensor's bytes back to back, in header order::

        [u64 n][header: n bytes][tensor 0][tensor 1]...   data_offsets are relative to the data start
    """
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; writing them on a big-endian host is unsupported")
    code, itemsize = DTYPES[spec.dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in shard.tensors:
        nbytes = math.prod(tensor.shape) * itemsize
        header[tensor.name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    dtype = getattr(torch, spec.dtype)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for tensor in shard.tensors:
            for chunk in _random_chunks(tensor, spec, dtype):
                f.write(chunk.view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def _random_chunks(tensor: TensorSpec, spec: ModelSpec, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor's values in row-major order, at most ``_CHUNK_ELEMENTS`` at a time."""
    import torch

    digest = hashlib.sha256(f"{spec.seed}/{tensor.name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    total = math.prod(tensor.shape)
    for start in range(0, total, _CHUNK_ELEMENTS):
        values = torch.randn(min(_CHUNK_ELEMENTS, total - start), generator=generator, dtype=torch.float32)
        if tensor.init == "norm":
            values.mul_(NORM_STD).add_(1.0)
        else:
            values.mul_(spec.init_std)
        yield values.to(dtype)


# ---------------------------------------------------------------- the embedded model's cache


DEFAULT_MODEL_NAME = "tiny-llama-v1"  # bump when TINY_LLAMA or the built-in tokenizer changes


def cache_dir() -> Path:
    """``$APP_CACHE_DIR``, or ``~/.cache/app``."""
    return Path(os.environ.get("APP_CACHE_DIR") or Path.home() / ".cache" / "app").expanduser()


def default_model_dir() -> Path:
    """The embedded tiny Llama, built in ``cache_dir()/models`` on first use, reused afterwards.

    Safe when several processes call it at once: a file lock serialises the builders, and
    ``make_checkpoint`` publishes the directory with an atomic rename, so readers never see a half
    written checkpoint. A directory that is incomplete or stale (manifest missing, a file missing
    or of the wrong size, another spec) is deleted and rebuilt.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if is_complete_checkpoint(target, TINY_LLAMA):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if not is_complete_checkpoint(target, TINY_LLAMA):
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            try:
                make_checkpoint(target, TINY_LLAMA)
            except OSError:
                # Where flock is not honoured (some network file systems) another process may
                # have renamed its build into place first; its build is as good as ours.
                if not is_complete_checkpoint(target, TINY_LLAMA):
                    raise
    return target


def is_complete_checkpoint(directory: Path, spec: ModelSpec) -> bool:
    """Whether ``directory`` holds a finished build of ``spec``: its manifest names the spec and
    every file it lists has the recorded size."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
        if manifest.get("format") != _MANIFEST_FORMAT or manifest.get("spec") != json.loads(
            json.dumps(dataclasses.asdict(spec))
        ):
            return False
        files = manifest["files"]
        return bool(files) and all((directory / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An advisory lock on ``path`` held for the block (released by the OS if the process dies)."""
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
