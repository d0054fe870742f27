"""The command line: every flag documented, bad values refused naming the flag."""

from __future__ import annotations

import pytest

from app.server_args import _parser, parse_server_args


def test_every_flag_has_help():
    undocumented = [a.option_strings[0] for a in _parser()._actions if a.option_strings and not a.help]
    assert undocumented == []


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--port", "70000"], "--port"),
        (["--max-prefill-tokens", "0"], "--max-prefill-tokens"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (["--page-size", "0"], "--page-size"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--stream-interval", "0"], "--stream-interval"),
        (["--model-path", "/no/such/dir"], "--model-path"),
    ],
)
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse_server_args(argv)


def test_defaults_follow_sglang():
    args = parse_server_args([])
    assert (args.host, args.port, args.max_prefill_tokens, args.page_size, args.stream_interval) == (
        "127.0.0.1", 30000, 16384, 1, 1)
    assert args.to_dict()["api_key"] is None
    assert parse_server_args(["--api-key", "secret"]).to_dict()["api_key"] == "<set>"


def test_fused_kernels_flag_defaults_to_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: None (auto) in the arguments and the engine config; both spellings set it; the
    builder resolves auto to on with CUDA and off on a CPU, where explicitly on needs triton's
    interpreter."""
    import torch

    from app.engine.switches import resolve_fused_kernels
    from app.engine.config import EngineConfig

    assert EngineConfig(model_path=".").fused_kernels is None
    assert parse_server_args([]).fused_kernels is None
    assert parse_server_args([]).engine_config(".").fused_kernels is None
    assert parse_server_args(["--fused-kernels"]).engine_config(".").fused_kernels is True
    assert parse_server_args(["--no-fused-kernels"]).engine_config(".").fused_kernels is False
    [action] = [a for a in _parser()._actions if "--fused-kernels" in a.option_strings]
    assert "--no-fused-kernels" in action.option_strings and "default: on with a CUDA device" in action.help

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_fused_kernels(None, cpu) is False
    assert resolve_fused_kernels(False, cpu) is False
    assert resolve_fused_kernels(None, cuda) is True
    assert resolve_fused_kernels(False, cuda) is False
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--fused-kernels needs a CUDA device"):
        resolve_fused_kernels(True, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_fused_kernels(True, cpu) is True
