"""The kernel plan: which kernels and launch variants run, resolved once at start from the device,
the model and the user's overrides, then read by every layer (the model's build, the attention
backends, the runner, the scheduler) and reported whole (``/server_info``, the "engine ready" log).

Two objects:

- :class:`KernelOptions`, the overrides as given: ``--kernel-options key=value,...`` (the flag may
  be repeated). Each key is a field below, declared once with its help; ``auto`` (the default of
  every key) lets the plan decide. An unknown key or a bad value is a ValueError listing the
  valid ones. A value that is itself a list joins its items with ``+`` (kernel_specs.py).
- :class:`KernelPlan`, what runs: :func:`resolve_kernel_plan` applies the rules below to the
  options, the device and the model, and raises ValueError naming the option (and the one it
  needs) when a combination cannot run here.

The rules, in order: fused-kernels, triton-gemv, fused-kv-alloc and fused-greedy are on with
CUDA (triton's kernels; on a CPU only under TRITON_INTERPRET=1); fused-decode follows the first
two; fused-qkv-rotary, fused-silu-out and fused-mlp follow fused-decode; gemv-pdl is on with
triton-gemv on Hopper or newer, in the modes the MLP path calls for; the persistent gemvs are
gate_up and lm_head up to a hidden size of 4,096; overlap-schedule and copy-stream are on with
CUDA; prefill graphs run up to 512 tokens where decode graphs and the triton prefill run.

A new option is declared, resolved and planned here, in one module: with the kernel that reads
the plan and the docs' table (``python -m app.engine.kernel_plan`` prints the table of keys that
docs/performance.md holds), that is every file it touches.
"""

from __future__ import annotations

import os
import sys
import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from app.engine.kernel_specs import (
    DEFAULT_GEMV_ROWS,
    DEFAULT_PDL_MODE,
    MLP_EARLY_TRIGGER_MAX_HIDDEN,
    PLAIN_MLP_PDL_MODE,
    FusedMlpKnobs,
    GemvBlockKnobs,
    GemvPdlRoles,
    GemvRowRoles,
    GemvRowsKnobs,
)
from app.engine.model_config import ModelConfig
from app.kernels.pdl_modes import GEMV_PDL_MODES
from app.kernels.prefill_tiling import packs_query_groups

if TYPE_CHECKING:  # torch itself is imported where it is called: the server parses options without loading it
    import torch

AUTO = "auto"
# Prefill graphs (prefill_graph.py): the smallest token count captured, and the largest by default.
MIN_PREFILL_GRAPH_TOKENS = 16
DEFAULT_PREFILL_GRAPH_MAX_TOKENS = 512
# The default gemv-rows applies to models whose hidden size is at most this (the 1B's 2,048 and
# the 8B's 4,096, where it was measured); wider models are not measured.
GEMV_ROWS_DEFAULT_MAX_HIDDEN = 4096
# The default copy-stream applies to steps of at most this many sampled rows: the side stream
# won on the H200 at 1, 16 and 48 sequences and lost at 256 (lab/notes/gpu_notes.md).
COPY_STREAM_MAX_BATCH = 48
# copy-stream=on: every step's tokens go out on the side stream, whatever its rows.
COPY_STREAM_EVERY_BATCH = 1 << 30
GRAPH_BACKENDS = ("triton", "flashinfer")  # backends whose decode metadata can live in static buffers
PREFILL_GRAPH_BACKENDS = ("triton",)  # backends whose EXTEND metadata can live in static buffers


def _option(help: str, *, auto: str, values: str = "on or off", parse: Callable[[str], object] | None = None,
            check: Callable[[int], bool] | None = None, default: Any = None) -> Any:
    """A kernel option: ``help`` says what and why, ``auto`` what the default resolves to,
    ``values`` what it takes besides auto; ``parse`` checks a structured value, ``check`` an integer."""
    return field(default=default, metadata={"help": help, "auto": auto, "values": values, "parse": parse,
                                            "check": check})


def _power_of_two_in(low: int, high: int) -> Callable[[int], bool]:
    return lambda n: low <= n <= high and n & (n - 1) == 0


@dataclass(frozen=True)
class KernelOptions:
    """The user's overrides of the kernel plan (None or ``"auto"``: the plan decides)."""

    fused_kernels: bool | None = _option(
        "our triton kernels for RMSNorm (+residual), rotary and SiLU-and-mul instead of torch's "
        "(on a CPU only under TRITON_INTERPRET=1, for debugging)", auto="on with CUDA")
    triton_gemv: bool | None = _option(
        "our decode-shaped triton kernel for the linear layers of batch-1 steps instead of cuBLAS, which "
        "is tuned for larger batches", auto="on with CUDA")
    fused_decode: bool | None = _option(
        "batch-1 steps in fewer kernels: each RMSNorm inside the next linear layer, SiLU-and-mul inside "
        "down_proj, the KV store inside rotary; needs fused-kernels and triton-gemv", auto="on when both are")
    fused_qkv_rotary: bool | None = _option(
        "the batch-1 qkv gemv also rotates q and k and stores K and V, one kernel fewer a layer (triton "
        "attention, no q/k norm); needs fused-decode", auto="with fused-decode")
    fused_silu_out: bool | None = _option(
        "the batch-1 gate_up gemv stores silu(gate) * up, so down is a plain gemv whose programs do not each "
        "recompute it; needs fused-decode", auto="with fused-decode")
    fused_mlp: bool | None = _option(
        "a batch-1 step runs each MLP (norm, gate_up, SiLU, down) as one persistent kernel that sums down's "
        "output with float32 atomics over down's weight stored transposed; its results differ from run to run "
        "in the last bits (off keeps batch-1 results bit-stable); needs fused-decode", auto="with fused-decode")
    fused_mlp_config: str = _option(
        "the fused MLP kernel's launch where it should differ from its tuned one, for A/B runs",
        auto="the tuned launch", values="name=value joined by '+' (names block_n, num_warps, num_stages, "
        "programs_per_sm, programs, early_tile)", parse=FusedMlpKnobs.parse, default="")
    gemv_pdl: bool | None = _option(
        "launch the batch-1 gemvs as programmatic dependents, each starting while the kernel before it "
        "ends (CUDA compute capability 9.0+); needs triton-gemv", auto="on where it can be")
    gemv_pdl_mode: str = _option(
        "with gemv-pdl, how each gemv overlaps its neighbours: preload (load the first weight tile, wait, let "
        "the next kernel start), wait, late (let the next one in after the K loop) or wait-late",
        auto=f"{DEFAULT_PDL_MODE} with fused-mlp up to hidden size {MLP_EARLY_TRIGGER_MAX_HIDDEN}, else "
        f"{PLAIN_MLP_PDL_MODE}", values=f"one of {', '.join(GEMV_PDL_MODES)} for every gemv, or role=mode "
        "joined by '+' (roles qkv, o, gate_up, down, lm_head; modes those or off)",
        parse=GemvPdlRoles.parse, default=AUTO)
    gemv_rows: str | None = _option(
        "the batch-1 gemvs that run persistent (a few programs an SM, each computing its input once and "
        "walking row tiles); these launch without PDL; needs triton-gemv",
        auto=f"{DEFAULT_GEMV_ROWS.replace(',', '+')} with triton-gemv up to hidden size "
        f"{GEMV_ROWS_DEFAULT_MAX_HIDDEN}, else off", values="off, all, or roles joined by '+'",
        parse=GemvRowRoles.parse)
    gemv_rows_config: str = _option(
        "the persistent gemvs' launches where they should differ from their tiling, for A/B runs; each role "
        "named must run persistent", auto="their tiling", values="role:name=value+... separated by ';' (names "
        "block_n, num_warps, num_stages, programs_per_sm)", parse=GemvRowsKnobs.parse, default="")
    gemv_config: str = _option(
        "the row-block gemvs' launches (the roles not persistent) where they should differ from their "
        "tiling, for A/B runs", auto="their tiling", values="role:name=value+... separated by ';' (names "
        "block_n, block_k, num_warps, num_stages)", parse=GemvBlockKnobs.parse, default="")
    fused_greedy: bool | None = _option(
        "an all-greedy step records its tokens, counters and stop tests in one triton kernel, and a batch-1 "
        "step's lm_head gemv folds its argmax into a few keys (with fused-decode)", auto="on with CUDA")
    fused_kv_alloc: bool | None = _option(
        "a step's KV slots come off the allocator's free list in one triton kernel instead of two or three "
        "of torch's", auto="on with CUDA")
    graph_inputs_advance: bool | None = _option(
        "a decode step of the same requests as the last, each a token further, moves its CUDA graph's "
        "positions and lengths on by one on the device instead of copying them from the host",
        auto="on with CUDA graphs")
    fused_split_reduce: bool | None = _option(
        "the triton decode attention merges its KV splits in its own last program instead of a second "
        "kernel (needs triton for decode steps)", auto="off: slower on the H200 so far")
    overlap_schedule: bool | None = _option(
        "queue decode step N+1 before reading step N's tokens, so that the host schedules while the GPU "
        "runs (--disable-overlap-schedule is off)", auto="on with CUDA; off on a CPU, where the host is "
        "the device and a token would only arrive a step later")
    copy_stream: bool | None = _option(
        "copy each step's sampled tokens to the host on a side stream, so that the next step's kernels do "
        "not queue behind the copy (CUDA); on: every step", auto=f"on with CUDA for steps of at most "
        f"{COPY_STREAM_MAX_BATCH} sampled rows (it loses at 256)")
    prefill_graph_max_tokens: int | None = _option(
        "prefills of one sequence of up to this many new tokens replay CUDA graphs captured at 16, 32, "
        "64, ... tokens (a short prompt's prefill is otherwise bound by the host launching its kernels); "
        "needs CUDA graphs and the triton prefill backend",
        auto=f"{DEFAULT_PREFILL_GRAPH_MAX_TOKENS} where they can run, else off",
        values=f"0 (off) or a whole number from {MIN_PREFILL_GRAPH_TOKENS}",
        check=lambda n: n == 0 or n >= MIN_PREFILL_GRAPH_TOKENS)
    triton_attention_num_kv_splits: int | None = _option(
        "the triton decode attention's most KV splits a sequence (1: one kernel a layer, no merging stage)",
        auto="16, fewer where the batch fills the GPU", values="a whole number from 1", check=lambda n: n >= 1)
    triton_decode_min_split_len: int | None = _option(
        "the triton decode attention's fewest tokens a split (a sequence gets a split per this many tokens, "
        "up to the cap)", auto="64", values="a whole number from 1", check=lambda n: n >= 1)
    triton_decode_block_n: int | None = _option(
        "keys a step of the triton decode attention's loop at every batch size", auto="64 (32 above head_dim "
        "128); 128 at mid batches on CUDA up to head_dim 64", values="a power of two from 16 to 256",
        check=_power_of_two_in(16, 256))
    triton_decode_num_warps: int | None = _option(
        "warps a program of the triton decode attention at every batch size",
        auto="2 where each sequence gets one split walked 64 keys a step, else 4", values="1, 2, 4, 8 or 16",
        check=_power_of_two_in(1, 16))
    triton_decode_num_stages: int | None = _option(
        "software-pipelining depth of the triton decode attention's key loop", auto="triton's",
        values="1 to 8", check=lambda n: 1 <= n <= 8)
    triton_decode_early_v: bool | None = _option(
        "the triton decode attention loads each V block beside its K block (more bytes in flight, more "
        "registers)", auto="off: V after the softmax")
    triton_decode_prefetch_slots: bool | None = _option(
        "each key block of the triton decode attention loads the next block's KV slots, so that its K/V "
        "loads need not wait for its own", auto="on with CUDA")
    triton_decode_step_slots: bool | None = _option(
        "decode steps of up to 8 sequences: the first layer's triton decode attention records each split's "
        "KV slots and the later layers read them, one memory round trip fewer", auto="on with CUDA")
    triton_decode_stage2_pdl: bool | None = _option(
        "the triton decode attention's stage 2 launches as a programmatic dependent of stage 1 (CUDA compute "
        "capability 9.0+)", auto="on where it can be")

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is None or value == spec.default:
                continue
            if spec.metadata["parse"] is not None:
                try:
                    spec.metadata["parse"](value)
                except ValueError as exc:  # it names the option; say where the option came from
                    raise ValueError(f"--kernel-options {exc}") from None
            elif spec.metadata["check"] is not None and not spec.metadata["check"](value):
                raise ValueError(f"--kernel-options {_key(spec.name)} takes auto or {spec.metadata['values']}, "
                                 f"got {value!r}")

    @classmethod
    def parse(cls, text: str) -> KernelOptions:
        """``key=value`` items separated by commas (``""``: every key auto); ValueError naming the
        key at fault with the keys or values it takes."""
        kinds = _option_kinds()
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = (part.strip() for part in item.partition("="))
            name = key.replace("-", "_")
            if name not in kinds:
                raise ValueError(f"--kernel-options: unknown key {key!r}; the keys are {', '.join(option_keys())} "
                                 "(docs/performance.md, 'Kernel options')")
            if not sep or name in values:
                raise ValueError(f"--kernel-options takes key=value items separated by commas, each key once; "
                                 f"got {item!r} in {text!r}")
            values[name] = _value(name, kinds[name], raw)
        return cls(**values)

    def spec(self) -> str:
        """The options given (not auto), as ``--kernel-options`` takes them."""
        items = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is None or value == spec.default:
                continue
            shown = ("on" if value else "off") if isinstance(value, bool) else str(value).replace(",", "+")
            items.append(f"{_key(spec.name)}={shown}")
        return ",".join(items)


def _key(name: str) -> str:
    return name.replace("_", "-")


def option_keys() -> list[str]:
    """Every key --kernel-options takes, in declaration order."""
    return [_key(spec.name) for spec in fields(KernelOptions)]


def _option_kinds() -> dict[str, type]:
    """Each option's value type: bool, int or str."""
    hints = typing.get_type_hints(KernelOptions)
    return {name: next(arg for arg in (*typing.get_args(kind), kind) if arg in (bool, int, str))
            for name, kind in hints.items()}


def _value(name: str, kind: type, raw: str) -> Any:
    """One option's value from its text; ``auto`` is the field's default."""
    spec = KernelOptions.__dataclass_fields__[name]
    if raw == AUTO:
        return spec.default
    if kind is bool and raw in ("on", "off"):
        return raw == "on"
    if kind is int and raw.isdigit():
        return int(raw)
    if kind is str and raw:
        return raw
    raise ValueError(f"--kernel-options {_key(name)} takes auto or {spec.metadata['values']}, got {raw!r}")


def options_table() -> str:
    """The markdown table of every key, for docs/performance.md (a test keeps the two equal)."""
    rows = ["| key | values | auto | what and why |", "|---|---|---|---|"]
    for spec in fields(KernelOptions):
        meta = spec.metadata
        rows.append(f"| `{_key(spec.name)}` | {meta['values']} | {meta['auto']} | {meta['help']} |")
    return "\n".join(rows)


class AttentionBackends(NamedTuple):
    """The resolved backend names: ``prefill`` serves EXTEND steps, ``decode`` DECODE steps and graphs."""

    prefill: str
    decode: str


class TritonDecodeKnobs(NamedTuple):
    """The triton decode attention's split rule and stage-1 launch from the ``triton-*`` options
    (None: the backend's default)."""

    max_kv_splits: int | None = None
    min_split_len: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    early_v: bool | None = None
    prefetch_slots: bool | None = None
    step_slots: bool | None = None
    stage2_pdl: bool | None = None

    def backend_kwargs(self) -> dict[str, int | bool]:
        """TritonAttentionBackend's keyword arguments for the knobs that are set."""
        named = {"max_kv_splits": self.max_kv_splits, "min_split_len": self.min_split_len,
                 "decode_block_n": self.block_n, "decode_warps": self.num_warps, "decode_num_stages": self.num_stages,
                 "decode_early_v": self.early_v, "decode_prefetch_slots": self.prefetch_slots,
                 "decode_step_slots": self.step_slots, "decode_stage2_pdl": self.stage2_pdl}
        return {key: value for key, value in named.items() if value is not None}


@dataclass(frozen=True)
class KernelPlan:
    """What runs on this device for this model: every kernel choice, resolved. ``KernelPlan()``
    is the plain plan, torch's kernels alone (what a CPU resolves to, but for overlap)."""

    attention: AttentionBackends = AttentionBackends("torch", "torch")
    fused_kernels: bool = False  # our triton norm / rotary / SiLU kernels in the model
    triton_gemv: bool = False  # one-row linear layers run our triton gemv
    fused_decode: bool = False  # one-token steps run the fused decode kernels
    gemv_pdl_mode: str = ""  # the gemvs' PDL modes (GemvPdlRoles.spec()); "" without PDL
    fused_qkv_rotary: bool = False  # the one-token qkv gemv rotates and stores K/V
    fused_silu_out: bool = False  # the one-token gate_up gemv stores silu(gate) * up
    fused_mlp: bool = False  # the one-token MLP is one kernel
    fused_mlp_knobs: FusedMlpKnobs = FusedMlpKnobs()  # its launch changes (none with fused_mlp off)
    gemv_rows: GemvRowRoles = GemvRowRoles()  # the roles whose one-row gemv runs persistent
    gemv_rows_knobs: GemvRowsKnobs = GemvRowsKnobs()  # their launch changes
    gemv_block_knobs: GemvBlockKnobs = GemvBlockKnobs()  # the row-block gemvs' launch changes
    fused_greedy: bool = False  # all-greedy steps record in one kernel; batch 1 folds the argmax
    fused_kv_alloc: bool = False  # a step's KV slots come off the free list in one kernel
    cuda_graphs: bool = False  # decode steps replay CUDA graphs (their batch sizes come with the pool's size)
    graph_inputs_advance: bool = False  # steady decode steps move their graph inputs on, on the device
    prefill_graph_max_tokens: int = 0  # one-sequence prefills up to this many tokens replay graphs (0: none)
    fused_split_reduce: bool = False  # the triton decode attention merges its splits in stage 1
    triton_decode: TritonDecodeKnobs = TritonDecodeKnobs()  # its launch changes
    overlap_schedule: bool = False  # decode step N+1 is queued before step N's tokens are read
    copy_stream: int = 0  # steps sampling at most this many rows copy tokens out on a side stream (0: off)

    @property
    def gemv_pdl(self) -> bool:
        return self.gemv_pdl_mode not in ("", "off")  # "off": every role's mode off

    @property
    def attention_triggers_o(self) -> bool:
        """Whether the triton decode attention lets the o projection start as it begins: when o
        launches as a programmatic dependent that preloads weight tiles ("preload" or "late"),
        which it then loads while the attention runs."""
        return attention_triggers_o(self.gemv_pdl_mode)

    def as_dict(self) -> dict[str, Any]:
        """Every choice as JSON values (specs as their canonical strings), for /server_info and the log."""
        values: dict[str, Any] = {"prefill_attention": self.attention.prefill, "decode_attention": self.attention.decode}
        values.update((spec.name, getattr(self, spec.name)) for spec in fields(self) if spec.name != "attention")
        values.update(
            gemv_pdl=self.gemv_pdl, gemv_rows=self.gemv_rows.spec(), fused_mlp_knobs=self.fused_mlp_knobs.changes(),
            gemv_rows_knobs=_launch_changes(self.gemv_rows_knobs), gemv_block_knobs=_launch_changes(self.gemv_block_knobs),
            triton_decode={key: value for key, value in self.triton_decode._asdict().items() if value is not None},
        )
        return values


def _launch_changes(knobs: GemvRowsKnobs | GemvBlockKnobs) -> dict[str, dict[str, int]]:
    return {role: launch.changes() for role, launch in zip(knobs._fields, knobs) if launch.changes()}


def resolve_kernel_plan(options: KernelOptions, *, device: torch.device, model_config: ModelConfig, attention_backend: str = AUTO,
                        decode_attention_backend: str | None = None, disable_cuda_graph: bool = False,
                        disable_overlap_schedule: bool = False, flashinfer_ok: Callable[[], bool]) -> KernelPlan:
    """The plan for ``options`` on ``device`` for ``model_config`` with the user's attention
    backends and switches (``flashinfer_ok``: whether flashinfer can serve here, asked only where
    it matters); ValueError naming the option (or flag) when it cannot run here."""
    group = model_config.num_heads // model_config.num_kv_heads
    attention = resolve_attention_backends(attention_backend, decode_attention_backend, device, model_config.head_dim,
                                           group, flashinfer_ok=flashinfer_ok)
    fused_kernels = resolve_triton_kernel(options.fused_kernels, device, "fused-kernels")
    triton_gemv = resolve_triton_kernel(options.triton_gemv, device, "triton-gemv")
    fused_decode = resolve_fused_decode(options.fused_decode, fused_kernels=fused_kernels, triton_gemv=triton_gemv)
    gemv_pdl = resolve_gemv_pdl(options.gemv_pdl, device, triton_gemv=triton_gemv)
    fused_mlp = follows_fused_decode(options.fused_mlp, fused_decode, "fused-mlp")
    auto_pdl_mode = resolve_auto_pdl_mode(fused_mlp=fused_mlp, hidden_size=model_config.hidden_size)
    gemv_rows = resolve_gemv_rows(options.gemv_rows, triton_gemv=triton_gemv, hidden_size=model_config.hidden_size)
    gemv_rows_knobs, gemv_block_knobs = resolve_gemv_launches(options, gemv_rows, triton_gemv=triton_gemv)
    cuda_graphs = not disable_cuda_graph and device.type == "cuda" and attention.decode in GRAPH_BACKENDS
    return KernelPlan(
        attention=attention,
        fused_kernels=fused_kernels,
        triton_gemv=triton_gemv,
        fused_decode=fused_decode,
        gemv_pdl_mode=GemvPdlRoles.parse(options.gemv_pdl_mode, auto=auto_pdl_mode).spec() if gemv_pdl else "",
        fused_qkv_rotary=follows_fused_decode(options.fused_qkv_rotary, fused_decode, "fused-qkv-rotary"),
        fused_silu_out=follows_fused_decode(options.fused_silu_out, fused_decode, "fused-silu-out"),
        fused_mlp=fused_mlp,
        fused_mlp_knobs=FusedMlpKnobs.parse(options.fused_mlp_config) if fused_mlp else FusedMlpKnobs(),
        gemv_rows=gemv_rows,
        gemv_rows_knobs=gemv_rows_knobs,
        gemv_block_knobs=gemv_block_knobs,
        fused_greedy=resolve_fused_greedy(options.fused_greedy, device),
        fused_kv_alloc=resolve_triton_kernel(options.fused_kv_alloc, device, "fused-kv-alloc"),
        cuda_graphs=cuda_graphs,
        # without a graph there is nothing to advance; with one the fused fill (CUDA) can
        graph_inputs_advance=cuda_graphs and options.graph_inputs_advance is not False,
        prefill_graph_max_tokens=resolve_prefill_graph_max_tokens(options.prefill_graph_max_tokens,
                                                                  attention.prefill, cuda_graphs),
        fused_split_reduce=resolve_fused_split_reduce(options.fused_split_reduce, attention.decode),
        triton_decode=resolve_triton_decode_knobs(options, attention.decode),
        overlap_schedule=resolve_overlap_schedule(options.overlap_schedule, device, disabled=disable_overlap_schedule),
        copy_stream=resolve_copy_stream(options.copy_stream, device),
    )


# The rules, one function an option; the tests call them directly.

def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on a GPU; float32 on a CPU (half precision is slow there)."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, model_config.dtype)


def resolve_attention_backend(name: str, device: torch.device, head_dim: int, *, flashinfer_ok: Callable[[], bool],
                              group: int = 1, flag: str = "--attention-backend") -> str:
    """``auto``: on a CUDA device triton where its prefill packs query groups (head_dim <= 64 with
    ``group`` query heads a KV head >= 2: app/kernels/prefill_tiling.py), else flashinfer where
    ``flashinfer_ok()`` (it imports, the dtype is half precision, the head size one of its), else
    triton; torch off CUDA. ``triton`` off CUDA only runs under triton's interpreter
    (TRITON_INTERPRET=1: slow, for debugging). Errors name ``flag``."""
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        if packs_query_groups(head_dim, group, device.type):
            return "triton"
        return "flashinfer" if flashinfer_ok() else "triton"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{flag} triton needs a CUDA device (--device is {device.type}); "
            "set TRITON_INTERPRET=1 to run its kernels interpreted on the CPU"
        )
    if name == "flashinfer" and not flashinfer_ok():
        raise ValueError(
            f"{flag} flashinfer needs CUDA, bf16 or fp16 (--dtype), head_dim 64, 128 or 256, "
            f"and flashinfer installed (the 'gpu' extra); here: device {device.type}, head_dim {head_dim}"
        )
    return name


def resolve_attention_backends(attention_backend: str, decode_attention_backend: str | None, device: torch.device,
                               head_dim: int, group: int = 1, *, flashinfer_ok: Callable[[], bool]) -> AttentionBackends:
    """``--attention-backend`` and ``--decode-attention-backend`` resolved. The decode backend
    None is the prefill's, except that after ``auto`` on CUDA decode steps run on triton, whose
    decode kernels beat flashinfer's at small batches while flashinfer's prefill may serve."""
    prefill = resolve_attention_backend(attention_backend, device, head_dim, group=group, flashinfer_ok=flashinfer_ok)
    if decode_attention_backend is None:
        auto_on_cuda = attention_backend == "auto" and device.type == "cuda"
        return AttentionBackends(prefill, "triton" if auto_on_cuda else prefill)
    decode = resolve_attention_backend(decode_attention_backend, device, head_dim, flashinfer_ok=flashinfer_ok,
                                       flag="--decode-attention-backend")
    return AttentionBackends(prefill, decode)


def resolve_triton_kernel(enabled: bool | None, device: torch.device, key: str) -> bool:
    """A switch to triton kernels (fused-kernels, triton-gemv, fused-kv-alloc): None is on with
    a CUDA device and off otherwise. On explicitly, triton needs CUDA, or on a CPU its
    interpreter (TRITON_INTERPRET=1: slow, for debugging). Raises ValueError naming the key."""
    if enabled is None:
        return device.type == "cuda"
    if enabled and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"--kernel-options {key}=on needs a CUDA device (--device is {device.type}); "
            "set TRITON_INTERPRET=1 to run its kernels interpreted on the CPU"
        )
    return enabled


def resolve_fused_decode(enabled: bool | None, *, fused_kernels: bool, triton_gemv: bool) -> bool:
    """fused-decode: None follows the resolved fused-kernels and triton-gemv (so on with CUDA):
    it builds on both (the rotary tables; the gemv kernel it extends). On without them raises
    ValueError naming the keys."""
    if enabled is None:
        return fused_kernels and triton_gemv
    if not enabled:
        return False
    if not (fused_kernels and triton_gemv):
        raise ValueError(
            "--kernel-options fused-decode=on needs fused-kernels and triton-gemv on (both auto to on with CUDA); "
            f"got fused-kernels={'on' if fused_kernels else 'off'}, triton-gemv={'on' if triton_gemv else 'off'}"
        )
    return True


def follows_fused_decode(enabled: bool | None, fused_decode: bool, key: str) -> bool:
    """fused-qkv-rotary, fused-silu-out, fused-mlp: None follows fused-decode, whose one-token
    kernels they extend; on without it raises ValueError naming the keys. (The model applies
    each where it fits: qkv rotary on the triton backend without a q/k norm, the MLP kernel
    where its shapes fit.)"""
    if enabled is None:
        return fused_decode
    if not enabled:
        return False
    if not fused_decode:
        raise ValueError(f"--kernel-options {key}=on needs fused-decode on (auto: on with CUDA); got fused-decode "
                         "off (or fused-kernels / triton-gemv off, which it needs)")
    return True


def resolve_auto_pdl_mode(*, fused_mlp: bool, hidden_size: int) -> str:
    """What gemv-pdl-mode=auto stands for: DEFAULT_PDL_MODE, where the MLP kernel lets the next
    layer's qkv launch at its start, with fused-mlp up to MLP_EARLY_TRIGGER_MAX_HIDDEN (where
    that was measured to pay); else PLAIN_MLP_PDL_MODE (the next kernel let in after the MLP's loop)."""
    if fused_mlp and hidden_size <= MLP_EARLY_TRIGGER_MAX_HIDDEN:
        return DEFAULT_PDL_MODE
    return PLAIN_MLP_PDL_MODE


def resolve_gemv_pdl(enabled: bool | None, device: torch.device, *, triton_gemv: bool) -> bool:
    """gemv-pdl: None is on where it can be: triton-gemv (the kernels it launches) on a CUDA
    device of compute capability 9.0 or newer (programmatic dependent launch came with Hopper).
    Asked for where it cannot be, a ValueError naming the key."""
    if enabled is False:
        return False
    lacking = _pdl_unsupported(device)
    possible = triton_gemv and lacking is None
    if enabled is None or possible:
        return possible
    if not triton_gemv:
        raise ValueError("--kernel-options gemv-pdl=on needs triton-gemv on (auto: on with CUDA); got triton-gemv=off")
    raise ValueError(f"--kernel-options gemv-pdl=on {lacking}")


def _pdl_unsupported(device: torch.device) -> str | None:
    """None where programmatic dependent launch works (CUDA, compute capability 9.0+: Hopper and
    newer), else why not, worded to follow an option's name."""
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability >= (9, 0):
        return None
    where = "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    return f"needs a CUDA device of compute capability 9.0 or newer; here: {where}"


def resolve_gemv_rows(spec: str | None, *, triton_gemv: bool, hidden_size: int = 0) -> GemvRowRoles:
    """gemv-rows: the roles whose one-row gemv runs persistent. None: DEFAULT_GEMV_ROWS with
    triton-gemv for a hidden size up to GEMV_ROWS_DEFAULT_MAX_HIDDEN, else none. Naming any role
    without triton-gemv is a ValueError."""
    if spec is None:
        measured = hidden_size <= GEMV_ROWS_DEFAULT_MAX_HIDDEN
        spec = DEFAULT_GEMV_ROWS if triton_gemv and measured else "off"
    rows = GemvRowRoles.parse(spec)
    if any(rows) and not triton_gemv:
        raise ValueError(f"--kernel-options gemv-rows={spec.replace(',', '+')} needs triton-gemv on (the persistent "
                         "kernel is one of its launches)")
    return rows


def resolve_gemv_launches(options: KernelOptions, rows: GemvRowRoles, *,
                          triton_gemv: bool) -> tuple[GemvRowsKnobs, GemvBlockKnobs]:
    """gemv-rows-config and gemv-config: each role named must run persistent (the first) or not
    (the second), and either needs triton-gemv; ValueError naming the keys."""
    rows_knobs = GemvRowsKnobs.parse(options.gemv_rows_config)
    idle = [role for role in rows_knobs.changed_roles() if not getattr(rows, role)]
    if idle:
        raise ValueError(f"--kernel-options gemv-rows-config changes {', '.join(idle)}, which do not run persistent "
                         f"(gemv-rows resolved to {rows.spec().replace(',', '+')!r})")
    block_knobs = GemvBlockKnobs.parse(options.gemv_config)
    if block_knobs.changed_roles() and not triton_gemv:
        raise ValueError("--kernel-options gemv-config changes the triton gemv's launches, which need triton-gemv on "
                         "(auto: on with CUDA); got triton-gemv=off")
    persistent = [role for role in block_knobs.changed_roles() if getattr(rows, role)]
    if persistent:
        raise ValueError(f"--kernel-options gemv-config changes {', '.join(persistent)}, which run persistent "
                         f"(gemv-rows resolved to {rows.spec().replace(',', '+')!r}): their launch is "
                         "gemv-rows-config's")
    return rows_knobs, block_knobs


def resolve_fused_greedy(enabled: bool | None, device: torch.device) -> bool:
    """fused-greedy: None is on with CUDA and off elsewhere. On, its kernels are triton's: CUDA,
    or TRITON_INTERPRET=1 on a CPU. Raises ValueError naming the key."""
    if enabled is None:
        return device.type == "cuda"
    return enabled and resolve_triton_kernel(True, device, "fused-greedy")


def resolve_prefill_graph_max_tokens(asked: int | None, prefill_backend: str, decode_graphs: bool) -> int:
    """The largest prefill graph's tokens (prefill_graph.py captures 16, 32, 64, ... up to it):
    0 (none) with 0, without decode graphs (--disable-cuda-graph, off CUDA, a backend without
    them) or where prefill steps run on a backend without static metadata; else
    prefill-graph-max-tokens (auto: DEFAULT_PREFILL_GRAPH_MAX_TOKENS). Asked for where it cannot
    be: ValueError."""
    if not decode_graphs or prefill_backend not in PREFILL_GRAPH_BACKENDS:
        if asked:
            raise ValueError(f"--kernel-options prefill-graph-max-tokens={asked} needs CUDA graphs (CUDA, no "
                             f"--disable-cuda-graph) and the triton prefill backend, got the {prefill_backend} "
                             f"backend{'' if decode_graphs else ' without CUDA graphs'}")
        return 0
    return DEFAULT_PREFILL_GRAPH_MAX_TOKENS if asked is None else asked


def resolve_fused_split_reduce(enabled: bool | None, decode_backend: str) -> bool:
    """fused-split-reduce: None is off (not yet faster). On, it changes the triton backend's
    decode attention, so it needs that backend. Raises ValueError naming the key."""
    if not enabled:
        return False
    if decode_backend != "triton":
        raise ValueError(f"--kernel-options fused-split-reduce=on changes the triton decode attention; decode steps "
                         f"run on {decode_backend} (resolved --attention-backend / --decode-attention-backend)")
    return True


def resolve_triton_decode_knobs(options: KernelOptions, decode_backend: str) -> TritonDecodeKnobs:
    """The triton-* options as given; any of them set needs triton for decode steps (ValueError naming them)."""
    knobs = TritonDecodeKnobs(options.triton_attention_num_kv_splits, options.triton_decode_min_split_len,
                              options.triton_decode_block_n, options.triton_decode_num_warps,
                              options.triton_decode_num_stages, options.triton_decode_early_v,
                              options.triton_decode_prefetch_slots, options.triton_decode_step_slots,
                              options.triton_decode_stage2_pdl)
    if knobs != TritonDecodeKnobs() and decode_backend != "triton":
        raise ValueError("--kernel-options triton-attention-num-kv-splits and triton-decode-* change the triton "
                         f"decode attention; decode steps run on {decode_backend} (resolved --attention-backend / "
                         "--decode-attention-backend)")
    return knobs


def resolve_overlap_schedule(enabled: bool | None, device: torch.device, *, disabled: bool = False) -> bool:
    """overlap-schedule: None is on with CUDA, where it hides the host's share of each decode
    step, and off elsewhere: on a CPU the "device" is the host, so there is nothing to hide and
    each token would only arrive a step later. ``disabled`` (--disable-overlap-schedule) is off;
    with overlap-schedule=on, a ValueError."""
    if disabled:
        if enabled:
            raise ValueError("--disable-overlap-schedule contradicts --kernel-options overlap-schedule=on")
        return False
    return device.type == "cuda" if enabled is None else enabled


def resolve_copy_stream(enabled: bool | None, device: torch.device) -> int:
    """copy-stream: the most rows a step may sample for its tokens to go to the host on the side
    stream; 0 is off (a CPU, or off). None is COPY_STREAM_MAX_BATCH with CUDA: the side stream
    takes the token copy off the next step's path, which pays at small batches and loses at
    256. On is every step (COPY_STREAM_EVERY_BATCH). Asked for off CUDA, a ValueError naming the
    key (a CPU has no streams)."""
    if enabled and device.type != "cuda":
        raise ValueError(f"--kernel-options copy-stream=on needs a CUDA device; here: {device.type}")
    if enabled is None:
        return COPY_STREAM_MAX_BATCH if device.type == "cuda" else 0
    return COPY_STREAM_EVERY_BATCH if enabled else 0


def attention_triggers_o(gemv_pdl_mode: str) -> bool:
    """Whether the triton decode attention should let the o projection start as it begins: when
    the o gemv launches as a programmatic dependent that preloads weight tiles ("preload" or
    "late" in the resolved gemv-pdl-mode; "" when PDL is off), which it then loads while the
    attention runs. With "wait" nothing could be loaded early."""
    return bool(gemv_pdl_mode) and GemvPdlRoles.parse(gemv_pdl_mode).o in ("preload", "late")


if __name__ == "__main__":
    sys.stdout.write(options_table() + "\n")
