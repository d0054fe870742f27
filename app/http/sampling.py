"""Building SamplingParams from what a client sent, for every API.

Each API names the fields its own way (OpenAI's ``max_tokens`` is SGLang's ``max_new_tokens``);
a field the client did not send takes the server's default (``defaults``: SGLang's, or the
model's generation_config.json). Ranges are checked once, by ``SamplingParams.validate``, and
its error is reported under the name the client used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from app.http.errors import ApiError
from app.ipc.messages import SamplingParams

_FIELDS = frozenset(SamplingParams.__struct_fields__)


def bias_pairs(logit_bias: Mapping[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings: the schema has checked
    that they are 1 to 10 digits) as (id, bias) pairs; None when absent or empty. Ranges and the
    vocabulary are checked by ``SamplingParams.validate``."""
    if not logit_bias:
        return None
    return tuple((int(key), float(bias)) for key, bias in logit_bias.items())


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...] | None:
    """OpenAI's and SGLang's ``stop``: one string or a list of them."""
    if stop is None:
        return None
    return (stop,) if isinstance(stop, str) else tuple(stop)


def make_sampling(
    defaults: SamplingParams,
    given: Mapping[str, Any],
    *,
    client_names: Mapping[str, str],
    vocab_size: int | None,
) -> SamplingParams:
    """``defaults`` with the fields in ``given`` that are not None; validated.

    ``client_names`` maps a SamplingParams field to the name the client used, for errors.
    Raises ApiError 400 naming the client's field.
    """
    params = msgspec.structs.replace(defaults, **{k: v for k, v in given.items() if v is not None})
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        # validate() starts its message with the field's name.
        field, _, rest = str(exc).partition(" ")
        name = client_names.get(field, field)
        raise ApiError.bad_request(f"{name} {rest}", param=name if field in _FIELDS else None) from None
    return params
