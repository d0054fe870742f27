"""Sampling defaults from a checkpoint's ``generation_config.json``, as users of other servers
expect: a request that leaves a field out gets the model author's value, not ours."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import msgspec

from app.ipc.messages import SamplingParams

# generation_config.json field -> SamplingParams field
_FIELDS = MappingProxyType({
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
})


def sampling_defaults(model_dir: str | Path) -> SamplingParams:
    """The defaults for ``model_dir``; SamplingParams() when the file is absent.

    Raises ValueError naming the file for a malformed file or an out-of-range value.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return SamplingParams()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    values = {ours: raw[theirs] for theirs, ours in _FIELDS.items() if raw.get(theirs) is not None}
    if values.get("top_k") == 0:
        values["top_k"] = -1
    try:
        defaults = msgspec.convert(values, SamplingParams)
        defaults.validate()
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return defaults
