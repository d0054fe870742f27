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
        (["--kernel-options", "fused-mlp=maybe"], "--kernel-options fused-mlp"),
        (["--schedule-conservativeness", "-1"], "--schedule-conservativeness"),
    ],
)
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse_server_args(argv)


def test_defaults_follow_sglang():
    args = parse_server_args([])
    engine = args.engine_config(".")
    assert (args.host, args.port, engine.max_prefill_tokens, engine.page_size, engine.stream_interval) == (
        "127.0.0.1", 30000, 16384, 1, 1)
    assert args.to_dict()["api_key"] is None
    assert parse_server_args(["--api-key", "secret"]).to_dict()["api_key"] == "<set>"


def test_fused_kernels_option_defaults_to_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: None (auto) in the engine config's options; on and off set it; the plan resolves
    auto to on with CUDA and off on a CPU, where explicitly on needs triton's interpreter."""
    import torch

    from app.engine.kernel_plan import KernelOptions, resolve_triton_kernel

    assert parse_server_args([]).engine_config(".").options.fused_kernels is None
    on = ["--kernel-options", "fused-kernels=on"]
    assert parse_server_args(on).engine_config(".").options.fused_kernels is True
    assert parse_server_args(["--kernel-options", "fused-kernels=off"]).engine_config(".").options == \
        KernelOptions(fused_kernels=False)
    assert parse_server_args(["--kernel-options", "fused-kernels=auto"]).engine_config(".").options == KernelOptions()

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_triton_kernel(None, cpu, "fused-kernels") is False
    assert resolve_triton_kernel(False, cpu, "fused-kernels") is False
    assert resolve_triton_kernel(None, cuda, "fused-kernels") is True
    assert resolve_triton_kernel(False, cuda, "fused-kernels") is False
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--kernel-options fused-kernels=on needs a CUDA device"):
        resolve_triton_kernel(True, cpu, "fused-kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_triton_kernel(True, cpu, "fused-kernels") is True


def test_kernel_options_may_be_repeated_and_list_values_join_with_plus():
    """Repeated --kernel-options add up; a structured value writes its list with '+' (its parser
    takes ',' from code too); every key given is kept and written back the same way."""
    from app.engine.kernel_plan import KernelOptions

    args = parse_server_args(["--kernel-options", "fused-mlp=off,gemv-rows=gate_up+down",
                              "--kernel-options", "gemv-pdl-mode=qkv=wait+down=late,triton-decode-block-n=32"])
    options = args.engine_config(".").options
    assert options == KernelOptions(fused_mlp=False, gemv_rows="gate_up+down", gemv_pdl_mode="qkv=wait+down=late",
                                    triton_decode_block_n=32)
    assert KernelOptions.parse(options.spec()) == options
    assert options.spec() == "fused-mlp=off,gemv-pdl-mode=qkv=wait+down=late,gemv-rows=gate_up+down,triton-decode-block-n=32"
    assert args.to_dict()["kernel_options"] == "fused-mlp=off,gemv-rows=gate_up+down,gemv-pdl-mode=qkv=wait+down=late," \
                                             "triton-decode-block-n=32"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("bogus=1", "unknown key 'bogus'; the keys are fused-kernels, triton-gemv, fused-decode"),
        ("fused-mlp=yes", "fused-mlp takes auto or on or off, got 'yes'"),
        ("triton-decode-block-n=48", "triton-decode-block-n takes auto or a power of two from 16 to 256, got 48"),
        ("prefill-graph-max-tokens=8", "prefill-graph-max-tokens takes auto or 0 (off) or a whole number from 16"),
        ("gemv-rows=gate_up+nope", "gemv-rows takes off, all or distinct roles joined by '+'"),
        ("gemv-pdl-mode=soon", "gemv-pdl-mode takes auto, one of preload, wait, late, wait-late"),
        ("fused-mlp-config=stages=2", "fused-mlp-config takes name=value pairs joined by '+'"),
        ("fused-mlp", "takes key=value items separated by commas, each key once"),
        ("fused-mlp=on,fused-mlp=off", "each key once"),
    ],
)
def test_a_bad_kernel_option_is_refused_with_the_valid_ones(options, message):
    with pytest.raises(ValueError, match="--kernel-options") as refused:
        parse_server_args(["--kernel-options", options])
    assert message in str(refused.value)


def test_the_kernel_switches_are_no_flags_of_their_own():
    """The A/B switches live in --kernel-options only; SGLang's spelling turns the overlap off."""
    flags = {option for action in _parser()._actions for option in action.option_strings}
    assert not flags & {"--fused-kernels", "--triton-gemv", "--fused-mlp", "--gemv-pdl-mode", "--overlap-schedule",
                        "--copy-stream", "--prefill-graph-max-tokens", "--triton-decode-block-n"}
    assert {"--attention-backend", "--decode-attention-backend", "--disable-cuda-graph", "--cuda-graph-max-bs",
            "--disable-overlap-schedule", "--chunked-prefill-size", "--kernel-options"} <= flags
    assert parse_server_args(["--disable-overlap-schedule"]).engine_config(".").disable_overlap_schedule is True


def test_docs_list_every_kernel_option_as_declared():
    """docs/performance.md holds the table that the declarations generate (python -m
    app.engine.kernel_plan): each key's values, its auto and what it does are written once."""
    from pathlib import Path

    from app.engine.kernel_plan import option_keys, options_table

    docs = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    assert options_table() in docs
    assert len(option_keys()) == len(set(option_keys())) == options_table().count("\n| `")
