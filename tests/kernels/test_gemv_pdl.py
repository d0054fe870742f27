"""The gemv kernels launched as programmatic dependents (``pdl=True``, ``gemv-pdl``).

With PDL a kernel's programs start while the kernel before it finishes and wait for it
(``griddepcontrol.wait``) before reading its output. A missing or misplaced wait shows as a read
of stale input: so each kernel of a chain reads what the one before wrote, the chain runs eagerly
and replayed from a CUDA graph with fresh inputs, and every result must equal, bit for bit, the
same chain launched the ordinary way (the arithmetic is the same; only the launch differs).
On a CPU the flag is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.kernel_plan import KernelOptions, attention_triggers_o, resolve_auto_pdl_mode, resolve_gemv_pdl
from app.engine.kernel_specs import DEFAULT_PDL_MODE, PLAIN_MLP_PDL_MODE, GemvPdlRoles
from app.kernels.triton_decode import decode_attention
from app.kernels.triton_gemv import PDL_MODES, GemvConfig, gemv, gemv_add_rms_norm, gemv_silu_mul, rows_config
from app.server_args import parse_server_args

HIDDEN, INTERMEDIATE, VOCAB = 2048, 8192, 32000  # Llama-3.2-1B's layer shapes, a smaller vocabulary


def _chain_weights(device: torch.device, layers: int = 3) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    return [
        {
            "qkv": rand(3072, HIDDEN, scale=HIDDEN**-0.5),
            "o": rand(HIDDEN, 2048, scale=2048**-0.5),
            "gate_up": rand(2 * INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5),
            "down": rand(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5),
            "norm": 1 + rand(HIDDEN, scale=0.1),
        }
        for _ in range(layers)
    ]


def _chain(x: torch.Tensor, layers: list[dict[str, torch.Tensor]], head: torch.Tensor, *,
           pdl: GemvPdlRoles) -> torch.Tensor:
    """A decoder-shaped sequence of dependent gemvs, each role launched with its mode: every
    kernel reads the previous one's output, through each kernel form (plain, norm prologue with
    and without a residual, SiLU-and-mul prologue and epilogue) and a split-K config (a second,
    ordinary kernel after the PDL one), and the persistent kernel (it launches plainly whatever
    the mode, which says when it lets the next kernel in: a row-block gemv after it, as down
    after gate_up in the model, may then start and load its first tile while it streams)."""
    residual = None
    h = x
    for w in layers:
        qkv, residual = gemv_add_rms_norm(h, residual, w["norm"], 1e-5, w["qkv"], pdl=pdl.qkv)
        h = gemv(qkv[:, :2048], w["o"], pdl=pdl.o)
        gate_up, residual = gemv_add_rms_norm(h, residual, w["norm"], 1e-5, w["gate_up"], pdl=pdl.gate_up)
        h = gemv_silu_mul(gate_up, w["down"], pdl=pdl.down)
        h = gemv(h, w["o"], config=GemvConfig(2, 512, split_k=4), pdl=pdl.o)
        act, residual = gemv_add_rms_norm(h, residual, w["norm"], 1e-5, w["gate_up"], silu_mul=True, pdl=pdl.gate_up)
        h = gemv(act, w["down"], pdl=pdl.down)
        act, residual = gemv_add_rms_norm(h, residual, w["norm"], 1e-5, w["gate_up"], silu_mul=True, pdl=pdl.gate_up,
                                          config=rows_config(2 * INTERMEDIATE, HIDDEN, even=True))
        h = gemv(act, w["down"], pdl=pdl.down)  # the model's pair: persistent gate_up, row-block down
        act, residual = gemv_add_rms_norm(h, residual, w["norm"], 1e-5, w["gate_up"], silu_mul=True, pdl=pdl.gate_up,
                                          config=rows_config(2 * INTERMEDIATE, HIDDEN, even=True))
        h = gemv(act, w["down"], config=rows_config(HIDDEN, INTERMEDIATE), pdl=pdl.down)
    return gemv(h + residual, head, pdl=pdl.lm_head)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [*PDL_MODES, DEFAULT_PDL_MODE, PLAIN_MLP_PDL_MODE])
def test_pdl_chain_equals_ordinary_launches_eager_and_in_a_graph(device: torch.device, mode: str) -> None:
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    layers = _chain_weights(device)
    head = (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(9)) * HIDDEN**-0.5).to(torch.bfloat16).to(device)
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=device)
    roles, off = GemvPdlRoles.parse(mode), GemvPdlRoles()

    gen = torch.Generator().manual_seed(1)
    first = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    x.copy_(first)
    expected = _chain(x, layers, head, pdl=off)
    assert torch.equal(_chain(x, layers, head, pdl=roles), expected)  # eager

    _chain(x, layers, head, pdl=roles)  # compile and warm before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, layers, head, pdl=roles)
    for _ in range(5):  # fresh inputs each replay: a stale read would show
        x.copy_(torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16).to(device))
        graph.replay()
        assert torch.equal(out, _chain(x, layers, head, pdl=off))
    assert not torch.equal(out, expected)  # the inputs did change


def test_pdl_is_refused_off_cuda(device: torch.device) -> None:
    """The kernel refuses pdl on a CPU; the flag parses, is off by default, and asked for off CUDA
    (or without triton-gemv) is a ValueError naming it."""
    x, w = torch.zeros(1, 64), torch.zeros(32, 64)
    for mode in (True, *PDL_MODES):
        with pytest.raises(ValueError, match=r"gemv: pdl \(programmatic dependent launch\) needs a CUDA device"):
            gemv(x, w, pdl=mode)
    with pytest.raises(ValueError, match="gemv: pdl must be a bool or one of preload, wait, late, wait-late, got 'early'"):
        gemv(x, w, pdl="early")
    xd, wd = x.to(device), w.to(device)
    assert torch.equal(gemv(xd, wd, pdl=""), gemv(xd, wd))  # "": a role without PDL, an ordinary launch
    assert parse_server_args([]).engine_config(".").options.gemv_pdl is None
    assert parse_server_args(["--kernel-options", "gemv-pdl=on"]).engine_config(".").options.gemv_pdl is True
    assert parse_server_args(["--kernel-options", "gemv-pdl=off"]).engine_config(".").options.gemv_pdl is False
    # The mode: per role unless asked, one of the kernels' modes or role=mode pairs, checked with the config.
    # auto (the default): the tuned modes of the MLP path in use; they differ in down's only, which
    # with fused-mlp is when the MLP kernel lets the next layer's qkv launch (at its start up to
    # hidden size 2048, where the 1B gained and the 8B lost).
    assert KernelOptions().gemv_pdl_mode == "auto" == parse_server_args([]).engine_config(".").options.gemv_pdl_mode
    assert GemvPdlRoles.parse(DEFAULT_PDL_MODE) == GemvPdlRoles("wait", "preload", "wait-late", "wait", "wait")
    assert GemvPdlRoles.parse(PLAIN_MLP_PDL_MODE) == GemvPdlRoles("wait", "preload", "wait-late", "late", "wait")
    assert resolve_auto_pdl_mode(fused_mlp=True, hidden_size=2048) == DEFAULT_PDL_MODE  # llama-3.2-1b
    assert resolve_auto_pdl_mode(fused_mlp=True, hidden_size=4096) == PLAIN_MLP_PDL_MODE  # llama-3.1-8b
    assert resolve_auto_pdl_mode(fused_mlp=False, hidden_size=2048) == PLAIN_MLP_PDL_MODE
    assert GemvPdlRoles.parse(" auto ", auto=PLAIN_MLP_PDL_MODE) == GemvPdlRoles.parse(PLAIN_MLP_PDL_MODE)
    assert GemvPdlRoles.parse("wait", auto=PLAIN_MLP_PDL_MODE) == GemvPdlRoles.parse("wait")  # only auto stands for it
    assert parse_server_args(["--kernel-options", "gemv-pdl=on,gemv-pdl-mode=wait"]).engine_config(".").options.gemv_pdl_mode == "wait"
    with pytest.raises(ValueError, match="--kernel-options gemv-pdl-mode takes auto, one of preload, wait, late, "
                                         r"wait-late or role=mode pairs joined by .*got 'early'"):
        EngineConfig(model_path=".", kernel_options="gemv-pdl-mode=early").validate()
    cpu = torch.device("cpu")
    assert not resolve_gemv_pdl(None, cpu, triton_gemv=True)  # the default: on only where it can be
    assert not resolve_gemv_pdl(None, device, triton_gemv=False)
    if device.type == "cuda":
        assert resolve_gemv_pdl(None, device, triton_gemv=True) == (torch.cuda.get_device_capability(device) >= (9, 0))
    assert not resolve_gemv_pdl(False, cpu, triton_gemv=True)
    with pytest.raises(ValueError, match="gemv-pdl=on needs a CUDA device of compute capability 9.0 or newer; here: a CPU"):
        resolve_gemv_pdl(True, cpu, triton_gemv=True)
    with pytest.raises(ValueError, match="gemv-pdl=on needs triton-gemv on"):
        resolve_gemv_pdl(True, cpu, triton_gemv=False)


def test_pdl_mode_per_role() -> None:
    """gemv-pdl-mode: one mode for every gemv of a step, or role=mode pairs (the others off),
    joined by '+' on the command line and by ',' from code too; the canonical spelling
    round-trips; unknown roles or modes and repeated roles are refused."""
    assert GemvPdlRoles.parse("wait") == GemvPdlRoles("wait", "wait", "wait", "wait", "wait")
    roles = GemvPdlRoles.parse(" qkv=wait, down = late ,gate_up=wait-late,o=off")
    assert roles == GemvPdlRoles(qkv="wait", gate_up="wait-late", down="late")
    assert roles.spec() == "qkv=wait,o=off,gate_up=wait-late,down=late,lm_head=off"
    assert GemvPdlRoles.parse(roles.spec()) == roles and GemvPdlRoles.parse("late").spec() == "late"
    assert GemvPdlRoles.parse("qkv=off").spec() == "off" and GemvPdlRoles.parse("off") == GemvPdlRoles()
    options = parse_server_args(["--kernel-options", "gemv-pdl=on,gemv-pdl-mode=qkv=wait+lm_head=preload"]).engine_config(".").options
    assert GemvPdlRoles.parse(options.gemv_pdl_mode) == GemvPdlRoles(qkv="wait", lm_head="preload")
    for bad, why in (("qkv=soon", "role=mode pairs joined by"), ("attn=wait", "role=mode pairs joined by"), ("qkv", "role=mode pairs joined by"),
                     ("qkv=wait,qkv=late", "names qkv twice")):
        with pytest.raises(ValueError, match=why):
            GemvPdlRoles.parse(bad)


def _attention_then_o(q: torch.Tensor, cache: tuple[torch.Tensor, ...], o_weight: torch.Tensor, *,
                      early: str = "") -> torch.Tensor:
    """A batch-1 step's decode attention and its o projection: with ``early`` (a preloading PDL
    mode) the attention's last kernel triggers its dependents and the o gemv launches as one that
    preloads its first tile."""
    k_cache, v_cache, table, rows, lens = cache
    attn = decode_attention(q, k_cache, v_cache, table, rows, lens, None, max_kv_splits=8, min_split_len=32,
                            trigger_dependents=bool(early))
    return gemv(attn.view(1, -1), o_weight, pdl=early)


@pytest.mark.gpu
@pytest.mark.parametrize("early", ["preload", "late"])
def test_attention_lets_the_o_gemv_start_early(device: torch.device, early: str) -> None:
    """decode_attention(trigger_dependents=True) followed by the o gemv as a preloading dependent
    (gemv-pdl-mode o=preload, the default, or o=late): equal, bit for bit, to the ordinary
    launches, eagerly and in a graph replayed with fresh queries (a read of the attention's output
    before its end would show)."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, slots = 32, 8, 64, 1024

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)

    cache = (rand(slots, kv_heads, head_dim), rand(slots, kv_heads, head_dim),
             torch.randperm(slots, generator=gen).to(torch.int32).view(1, slots).to(device),
             torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([700], device=device))
    o_weight = rand(HIDDEN, heads * head_dim) * (heads * head_dim) ** -0.5
    q = rand(1, heads, head_dim)
    expected = _attention_then_o(q, cache, o_weight)
    assert torch.equal(_attention_then_o(q, cache, o_weight, early=early), expected)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _attention_then_o(q, cache, o_weight, early=early)
    for _ in range(5):
        q.copy_(rand(1, heads, head_dim))
        graph.replay()
        assert torch.equal(out, _attention_then_o(q, cache, o_weight))
    assert not torch.equal(out, expected)


def test_attention_trigger_is_refused_off_cuda_and_follows_the_o_mode() -> None:
    """The trigger is a CUDA instruction: refused on a CPU with a clear error. The engine turns it
    on only where the o gemv preloads as a dependent (its resolved gemv-pdl-mode)."""
    q, cache = torch.zeros(1, 4, 16), torch.zeros(8, 2, 16)
    table, lens = torch.arange(8).view(1, 8), torch.tensor([8])
    with pytest.raises(ValueError, match=r"trigger_dependents \(programmatic dependent launch\) needs a CUDA device"):
        decode_attention(q, cache, cache, table, torch.zeros(1, dtype=torch.int64), lens, None,
                         trigger_dependents=True)
    assert attention_triggers_o("qkv=wait,o=preload,gate_up=wait-late,down=late,lm_head=wait")
    assert attention_triggers_o("late") and attention_triggers_o("preload")
    assert attention_triggers_o(DEFAULT_PDL_MODE) and not attention_triggers_o("wait")
    assert not attention_triggers_o("qkv=wait,o=wait,gate_up=wait-late,down=late,lm_head=wait")
    assert not attention_triggers_o("")  # PDL off
