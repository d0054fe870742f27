"""Load a Hugging Face checkpoint directory into our model, tensor by tensor.

Parameters are allocated once on the target device and dtype (``build_model``); each safetensors
tensor is then read on its own and copied (with the dtype cast) into its place, so host memory
never holds more than one tensor of the checkpoint at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from app.engine.model_config import ModelConfig
from app.engine.models import CausalLM, build_model
from app.engine.models.llama import WeightTarget

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(model_dir: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> CausalLM:
    """Parse ``config.json``, build the model, load its weights. ``dtype`` None: the checkpoint's.

    Raises FileNotFoundError for a missing config or weight file, ValueError for an unsupported
    config or a missing, unexpected or misshapen tensor; each message names the file and tensor.
    """
    config = ModelConfig.from_pretrained(model_dir)
    model = build_model(config, dtype=dtype or getattr(torch, config.dtype), device=device)
    load_weights(model, model_dir)
    return model


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those of the shard index, else ``model.safetensors``,
    else every ``*.safetensors`` file. Raises FileNotFoundError naming what is missing."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: not a safetensors index with a weight_map ({exc!r})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing file, listed as a shard in {index_path}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
    return files


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that we do not need: cached rotary tables, a tied lm_head copy."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``model_dir`` (see load_model)."""
    targets = model.checkpoint_tensors()
    loaded: dict[str, Path] = {}
    for path in checkpoint_files(model_dir):
        with _open_safetensors(path) as f:
            for name in f.keys():
                if _ignored(name, model.config):
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"{path}: unexpected tensor {name!r} with shape {shape} for {model.config.architecture}")
                if name in loaded:
                    raise ValueError(f"{path}: tensor {name!r} is also in {loaded[name]}")
                dest = target.view
                if shape != tuple(dest.shape):
                    raise ValueError(
                        f"{path}: tensor {name!r} has shape {shape}, but config.json implies {tuple(dest.shape)}"
                    )
                with torch.no_grad():
                    dest.copy_(f.get_tensor(name))
                loaded[name] = path
    missing = [name for name in targets if name not in loaded]
    if missing:
        raise ValueError(_missing_message(Path(model_dir), missing, targets))


def _open_safetensors(path: Path) -> Any:
    """``safe_open`` with the file's name in the error when it is not a safetensors file."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own (Rust) error type for a bad header
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc


def _missing_message(model_dir: Path, missing: list[str], targets: dict[str, WeightTarget]) -> str:
    """Name the file each missing tensor should be in: its shard per the index, else the files read."""
    weight_map: dict[str, str] = {}
    if (model_dir / INDEX_FILE).is_file():
        weight_map = json.loads((model_dir / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
    searched = ", ".join(str(p) for p in checkpoint_files(model_dir))
    lines = []
    for name in missing[:5]:
        shard = weight_map.get(name)
        where = f"{model_dir / shard} (per {INDEX_FILE})" if shard else searched
        lines.append(f"{where}: missing tensor {name!r} of shape {tuple(targets[name].view.shape)}")
    if len(missing) > 5:
        lines.append(f"... and {len(missing) - 5} more missing tensors")
    return "\n".join(lines)
