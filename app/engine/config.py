"""The engine's configuration: checked once, at start, and never changed afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from app.kernels.pdl_modes import GEMV_PDL_MODES

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# Prefill graphs (prefill_graph.py): the smallest token count captured, and the largest by default.
MIN_PREFILL_GRAPH_TOKENS = 16
# On the H200 a 128-token prompt's prefill took 2.1 ms against 12.9 (docs/gpu_notes.md, variant 94), and
# a 128 + 1,024-token request 802.5 / 801.3 ms against 810.3 / 810.6 without them (variant 95, once the
# captures shared one side stream: a second one had made every decode step ~20 µs slower).
DEFAULT_PREFILL_GRAPH_MAX_TOKENS = 512
# --gemv-pdl-mode's tuned modes, per role, from the H200's batch-1 runs (docs/gpu_notes.md, variants
# 33 and 35: 1,097 tok/s against 1,027 without PDL, and 1,083-1,088 with one mode for all). They
# differ in down's only. With --fused-mlp, down's mode is the MLP kernel's trigger: "wait" lets
# the next layer's qkv launch at the kernel's start, its programs resident and waiting when it
# ends (variants 92 and 97: the 1B 1,281.8-1,282.3 against 1,267.3-1,269.5 tok/s; the 8B 253.2
# against 253.9, so up to MLP_EARLY_TRIGGER_MAX_HIDDEN only); the down gemv and the wider MLP
# kernels let the next kernel in after their loop ("late"). --gemv-pdl-mode auto picks one
# (switches.resolve_auto_pdl_mode).
DEFAULT_PDL_MODE = "qkv=wait,o=preload,gate_up=wait-late,down=wait,lm_head=wait"
PLAIN_MLP_PDL_MODE = "qkv=wait,o=preload,gate_up=wait-late,down=late,lm_head=wait"
MLP_EARLY_TRIGGER_MAX_HIDDEN = 2048


class GemvPdlRoles(NamedTuple):
    """The PDL mode of each gemv of a batch-1 decode step ("" = an ordinary launch), from
    ``--gemv-pdl-mode``: one mode for all, or ``role=mode,...`` (roles not named: off). On the
    H200 the best mode differed by role (docs/gpu_notes.md, variants 33 and 35): a norm prologue loses
    with a preloaded tile, and the down projection after gate_up gains when gate_up lets it in late.
    With --fused-mlp, down's mode says whether the MLP kernel lets qkv launch, at its programs'
    start (an early mode) or after their loop (a late one); gate_up's is unused: the kernel
    launches plainly."""

    qkv: str = ""
    o: str = ""
    gate_up: str = ""
    down: str = ""
    lm_head: str = ""

    @classmethod
    def parse(cls, spec: str, *, auto: str = DEFAULT_PDL_MODE) -> GemvPdlRoles:
        """``"wait"`` (every role), ``"off"`` (none), ``"qkv=wait,down=late"`` or ``"auto"``, which
        stands for ``auto`` (the builder passes the model's: switches.resolve_auto_pdl_mode);
        ValueError naming what is wrong."""
        spec = spec.strip()
        if spec == "auto":
            spec = auto
        if spec in GEMV_PDL_MODES:
            return cls(*(spec,) * len(cls._fields))
        if spec == "off":  # what spec() writes when every role is off
            return cls()
        roles: dict[str, str] = {}
        for item in spec.split(","):
            role, sep, mode = (part.strip() for part in item.partition("="))
            if not sep or role not in cls._fields or mode not in GEMV_PDL_MODES + ("off",):
                raise ValueError(
                    f"--gemv-pdl-mode takes auto, one of {', '.join(GEMV_PDL_MODES)} or role=mode pairs separated by "
                    f"commas (roles {', '.join(cls._fields)}; modes those or off), got {spec!r}")
            if role in roles:
                raise ValueError(f"--gemv-pdl-mode names {role} twice in {spec!r}")
            roles[role] = "" if mode == "off" else mode
        return cls(**roles)

    def spec(self) -> str:
        """The canonical spelling: one mode when all roles share it, else role=mode pairs."""
        if len(set(self)) == 1:
            return self[0] or "off"
        return ",".join(f"{role}={mode or 'off'}" for role, mode in zip(self._fields, self))


# The roles whose batch-1 gemv runs persistent by default (with --triton-gemv): where the
# kernel won in the model on the H200 (docs/gpu_notes.md, variant 52).
DEFAULT_GEMV_ROWS = "gate_up,lm_head"


class GemvRowRoles(NamedTuple):
    """The gemv kernels of a batch-1 decode step that run persistent (``--gemv-rows``:
    triton_gemv_rows.py, a few programs an SM walking row tiles, x computed once a program),
    from ``"off"``, ``"all"`` or roles separated by commas (``"gate_up,down"``)."""

    qkv: bool = False
    o: bool = False
    gate_up: bool = False
    down: bool = False
    lm_head: bool = False

    @classmethod
    def parse(cls, spec: str) -> GemvRowRoles:
        """ValueError naming the flag on anything else."""
        spec = spec.strip()
        if spec in ("off", ""):
            return cls()
        if spec == "all":
            return cls(*(True,) * len(cls._fields))
        roles = [role.strip() for role in spec.split(",")]
        unknown = [role for role in roles if role not in cls._fields]
        if unknown or len(set(roles)) != len(roles):
            raise ValueError(f"--gemv-rows takes off, all or distinct roles separated by commas (of "
                             f"{', '.join(cls._fields)}), got {spec!r}")
        return cls(**{role: True for role in roles})

    def spec(self) -> str:
        """The canonical spelling: off, all, or the roles in order."""
        if not any(self):
            return "off"
        if all(self):
            return "all"
        return ",".join(role for role, on in zip(self._fields, self) if on)


class RowLaunch(NamedTuple):
    """One role's persistent gemv launch knobs (triton_gemv.GemvConfig's fields; None: rows_config's)."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    programs_per_sm: int | None = None

    def changes(self) -> dict[str, int]:
        """The knobs given, as GemvConfig._replace takes them."""
        return _given(self)


class BlockLaunch(NamedTuple):
    """One role's row-block gemv launch knobs (triton_gemv.GemvConfig's fields; None: default_config's)."""

    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def changes(self) -> dict[str, int]:
        """The knobs given, as GemvConfig._replace takes them."""
        return _given(self)


def _given(launch: tuple) -> dict[str, int]:
    return {name: value for name, value in zip(launch._fields, launch) if value is not None}  # type: ignore[attr-defined]


def _role_launches(spec: str, flag: str, roles: tuple[str, ...], launch_cls: type) -> dict[str, Any]:
    """``role:name=value,...`` separated by ";" as ``{role: launch_cls(...)}``; ValueError naming ``flag``."""
    usage = (f"{flag} takes role:name=value,... separated by ';' (roles {', '.join(roles)}, each once; names "
             f"{', '.join(launch_cls._fields)}, each once a role; values positive whole numbers, block_n and block_k "
             f"powers of two, num_warps 1, 2, 4, 8 or 16), got {spec!r}")
    launches: dict[str, Any] = {}
    for part in filter(None, (chunk.strip() for chunk in spec.split(";"))):
        role, sep, pairs = (piece.strip() for piece in part.partition(":"))
        if not sep or role not in roles or role in launches:
            raise ValueError(usage)
        knobs: dict[str, int] = {}
        for item in filter(None, (pair.strip() for pair in pairs.split(","))):
            name, eq, value = (piece.strip() for piece in item.partition("="))
            if not eq or name not in launch_cls._fields or name in knobs or not value.isdigit() or int(value) < 1:
                raise ValueError(usage)
            knobs[name] = int(value)
        powers = [knobs.get(name, 1) for name in ("block_n", "block_k")]
        if not knobs or knobs.get("num_warps", 4) not in (1, 2, 4, 8, 16) or any(n & (n - 1) for n in powers):
            raise ValueError(usage)
        launches[role] = launch_cls(**knobs)
    return launches


class GemvRowsKnobs(NamedTuple):
    """``--gemv-rows-config``: the persistent gemv's launch where it should differ from
    rows_config's tiling, by role (GemvRowRoles' names), from
    ``"lm_head:programs_per_sm=1,num_warps=8,num_stages=4;qkv:num_stages=4"``, for A/B runs
    through the engine without a code change (the fused MLP kernel gained 0.6 us a layer at one
    program an SM and 4 stages, variant 85; at that launch every persistent gemv lost, 86)."""

    qkv: RowLaunch = RowLaunch()
    o: RowLaunch = RowLaunch()
    gate_up: RowLaunch = RowLaunch()
    down: RowLaunch = RowLaunch()
    lm_head: RowLaunch = RowLaunch()

    @classmethod
    def parse(cls, spec: str) -> GemvRowsKnobs:
        """``""`` (none) or ``role:name=value,...`` separated by ";"; ValueError naming the flag."""
        return cls(**_role_launches(spec, "--gemv-rows-config", cls._fields, RowLaunch))

    def changed_roles(self) -> list[str]:
        """The roles whose launch the spec changes."""
        return [role for role, launch in zip(self._fields, self) if launch.changes()]


class GemvBlockKnobs(NamedTuple):
    """``--gemv-config``: the row-block gemv's launch (the kernel of the roles that do not run
    persistent) where it should differ from default_config's, by role, from
    ``"qkv:num_stages=2;o:block_k=2048,num_warps=8"``, for A/B runs through the engine without a
    code change (the row-block tilings were swept alone, before the gemvs ran as programmatic
    dependents of the kernels around them)."""

    qkv: BlockLaunch = BlockLaunch()
    o: BlockLaunch = BlockLaunch()
    gate_up: BlockLaunch = BlockLaunch()
    down: BlockLaunch = BlockLaunch()
    lm_head: BlockLaunch = BlockLaunch()

    @classmethod
    def parse(cls, spec: str) -> GemvBlockKnobs:
        """``""`` (none) or ``role:name=value,...`` separated by ";"; ValueError naming the flag."""
        return cls(**_role_launches(spec, "--gemv-config", cls._fields, BlockLaunch))

    def changed_roles(self) -> list[str]:
        """The roles whose launch the spec changes."""
        return [role for role, launch in zip(self._fields, self) if launch.changes()]


class FusedMlpKnobs(NamedTuple):
    """``--fused-mlp-config``: launch knobs of the batch-1 MLP kernel that differ from its tuned
    defaults (triton_fused_mlp.FusedMlpConfig, whose fields these are; None: the default), from
    ``"block_n=8,num_warps=8,early_tile=1"``, for A/B runs through the engine without a code change."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    programs_per_sm: int | None = None
    programs: int | None = None
    early_tile: bool | None = None

    @classmethod
    def parse(cls, spec: str) -> FusedMlpKnobs:
        """``""`` (the defaults) or ``name=value`` pairs separated by commas; ValueError naming the flag."""
        knobs: dict[str, int | bool] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, value = (part.strip() for part in item.partition("="))
            if not sep or name not in cls._fields or name in knobs or not value.isdigit():
                raise ValueError(f"--fused-mlp-config takes name=value pairs separated by commas (names "
                                 f"{', '.join(cls._fields)}, each once; values whole numbers), got {spec!r}")
            knobs[name] = bool(int(value)) if name == "early_tile" else int(value)
        return cls(**knobs)

    def changes(self) -> dict[str, int | bool]:
        """The knobs given, as FusedMlpConfig._replace takes them."""
        return {name: value for name, value in zip(self._fields, self) if value is not None}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What the engine needs to know; every field has the name of its command-line flag.

    ``None`` means "derive it": from the model (context length), from memory (pool size), or
    from the pool (running requests). :func:`EngineConfig.validate` raises ValueError naming the
    flag for anything out of range.
    """

    model_path: str
    dtype: str = "auto"  # auto: the checkpoint's dtype (float32 on a CPU when it is half precision)
    device: str = "auto"  # auto: cuda when available
    context_length: int | None = None  # default: the model's
    max_total_tokens: int | None = None  # KV pool size in tokens
    # On a GPU: share of its memory for the weights, the KV pool, the largest step's activations
    # and the CUDA graphs (the pool gets what the rest leaves; see memory_budget.py).
    mem_fraction_static: float = 0.85
    page_size: int = 1  # KV slots per page: allocation, prefix caching and eviction in whole pages
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384  # prompt tokens admitted per prefill step
    chunked_prefill_size: int | None = None  # split prompts longer than this; -1 disables
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    # The backend of decode steps (and their CUDA graphs), when it should differ from
    # attention_backend (which then serves prefill/extend steps only). None: the same, except
    # triton when attention_backend is auto on CUDA (resolve_attention_backends in switches.py).
    decode_attention_backend: str | None = None
    # Future decode tokens reserved for each running request, as a share of what it may still
    # generate, when admitting new requests (retraction covers a wrong guess).
    new_token_ratio: float = 0.4
    stream_interval: int = 1  # tokens per streamed output (the first token goes at once)
    # Decode steps of up to this many sequences replay CUDA graphs (CUDA, triton backend);
    # None: min(max_running_requests, 256).
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    # Prefill (EXTEND) steps of one sequence of up to this many new tokens replay CUDA graphs
    # captured at 16, 32, 64, ... tokens (app/engine/prefill_graph.py: the prefill of a short
    # prompt is host-bound). 0: off. Needs decode graphs and the triton prefill backend. None:
    # DEFAULT_PREFILL_GRAPH_MAX_TOKENS (512) where they run (builder.prefill_graph_token_counts).
    prefill_graph_max_tokens: int | None = None
    # Our triton kernels for RMSNorm (+residual), rotary and SiLU-and-mul in the model. None: on
    # with a CUDA device, off otherwise; True needs CUDA, or TRITON_INTERPRET=1 on a CPU (resolved
    # and checked in the builder, once the device is known: resolve_fused_kernels).
    fused_kernels: bool | None = None
    # Our decode-shaped linear kernel (app/kernels/triton_gemv.py) for one-row inputs (batch-1
    # decode) instead of cuBLAS; same rules as fused_kernels (None: on with a CUDA device).
    triton_gemv: bool | None = None
    # Steps of one token (batch-1 decode) in fewer kernels: each RMSNorm inside the linear layer
    # after it, SiLU-and-mul inside down_proj, the KV store inside the rotary kernel (triton
    # backend). Needs fused_kernels and triton_gemv on. None: on when both are (so with CUDA;
    # resolve_fused_decode in switches.py).
    fused_decode: bool | None = None
    # The batch-1 gemv kernels launch as programmatic dependents (Hopper and newer): each starts
    # while the kernel before it finishes. None: on where it can be (triton_gemv on a CUDA device
    # of compute capability 9.0+; resolve_gemv_pdl in switches.py).
    gemv_pdl: bool | None = None
    # With gemv_pdl: "preload" (its first weight tile before the wait, the next kernel let in
    # after it), "wait" (no tile before the wait), "late" (the next kernel let in after the K
    # loop), "wait-late" (both without the tile); see triton_gemv.PDL_MODES. Or per gemv of the
    # step: "qkv=wait,o=preload,gate_up=wait-late,down=late,lm_head=wait" (GemvPdlRoles). In the
    # gemv stack alone preload was fastest; inside the model the best differed by role. With
    # o=preload (or late) the triton decode attention triggers o at its start, so that o's first
    # tiles load during the attention (docs/gpu_notes.md, variant 53).
    gemv_pdl_mode: str = "auto"  # auto: DEFAULT_PDL_MODE or PLAIN_MLP_PDL_MODE (switches.resolve_auto_pdl_mode)
    # With fused_decode on the triton backend, the qkv gemv of a one-token step also rotates q and
    # k and stores K and V (no rotary kernel after it; not with a q/k norm). None: follows
    # fused_decode (resolve_fused_qkv_rotary in switches.py).
    fused_qkv_rotary: bool | None = None
    # With fused_decode, the gate_up gemv of a one-token step stores silu(gate) * up, so the down
    # projection is a plain gemv (its programs no longer each recompute the SiLU of the whole
    # row). None: follows fused_decode (resolve_fused_silu_out in switches.py).
    fused_silu_out: bool | None = None
    # With fused_decode, a one-token step runs each MLP as one persistent kernel (triton_fused_mlp:
    # gate_up, SiLU and down, down's output summed with float32 atomics over its weight stored
    # transposed). None: follows fused_decode (batch 1 on the H200 +1.5 to +4.2 %, steps of more
    # rows unchanged or faster; results differ from run to run in the last bits; resolve_fused_mlp
    # in switches.py).
    fused_mlp: bool | None = None
    # Its launch knobs where they differ from the tuned defaults (FusedMlpKnobs: "" or
    # "block_n=8,early_tile=1"); checked against the model when it is built.
    fused_mlp_config: str = ""
    # The batch-1 gemv kernels (triton_gemv) that run persistent, by role (GemvRowRoles: "off",
    # "all" or e.g. "gate_up,down"): a few programs an SM, each computing its x once (the norm
    # prologue) and walking row tiles, instead of a program per row block; such a gemv launches
    # without PDL. None: DEFAULT_GEMV_ROWS with triton_gemv where the hidden size is at most 4,096
    # (measured there; resolve_gemv_rows in switches.py).
    gemv_rows: str | None = None
    # The persistent gemvs' launches where they differ from rows_config's (GemvRowsKnobs: "" or
    # "lm_head:programs_per_sm=1,num_warps=8"); each role named must run persistent (gemv_rows).
    gemv_rows_config: str = ""
    # The row-block gemvs' launches where they differ from default_config's (GemvBlockKnobs: "" or
    # "qkv:num_stages=2"); each role named must not run persistent.
    gemv_config: str = ""
    # Greedy steps in fewer kernels: the sampler records an all-greedy step (token, counters,
    # stop and length tests) in one triton kernel, and a batch-1 step's output projection folds
    # its argmax into a few keys (with fused_decode). Needs triton (CUDA, or TRITON_INTERPRET=1).
    # None: on with CUDA (resolve_fused_greedy in switches.py).
    fused_greedy: bool | None = None
    # A step's KV slots popped from the allocator's free list in one triton kernel (SlotAllocator's
    # fused_pop). Needs triton. None: on with CUDA (resolve_fused_kernels in switches.py).
    fused_kv_alloc: bool | None = None
    # A decode step of the same requests as the last, each a token further, moves the graph's
    # positions and lengths on by one on the device instead of copying every column from the host
    # (StaticDecodeInputs' advance). None: on wherever graphs fill their inputs with the fused
    # kernel (CUDA).
    graph_inputs_advance: bool | None = None
    # The triton backend's decode attention merges its KV splits in the last program of each
    # sequence and kv head instead of a second kernel: one kernel per layer. None: off (slower on
    # the H200 so far; resolve_fused_split_reduce in switches.py).
    fused_split_reduce: bool | None = None
    # Queue decode step N+1 before reading step N's tokens (scheduler.py). None: off for now
    # (see resolve_overlap_schedule in switches.py).
    overlap_schedule: bool | None = None
    # Copy each step's sampled tokens to the host on a side stream (CUDA), so that the next
    # step's kernels do not queue behind the copy engine. None: on with CUDA for decode steps of
    # at most 48 rows, and prefill steps that sample at most 48 (COPY_STREAM_MAX_BATCH: it won at
    # 1, 16 and 48 sequences and lost at 256); True: every step (resolve_copy_stream in switches.py).
    copy_stream: bool | None = None
    # The triton decode attention's split rule and stage-1 launch (None: its defaults, 16 splits
    # at most, one per 64 tokens, keys and warps a step by batch (TritonAttentionBackend.
    # decode_launch: 64 keys up to head_dim 128, 128 at mid batches), triton's pipelining, V after
    # the softmax, each block's own slots), for A/B runs (docs/gpu_notes.md, lead 4 and variant 63).
    # A cap of 1 runs one kernel a layer (no merging stage).
    triton_attention_num_kv_splits: int | None = None
    triton_decode_min_split_len: int | None = None
    triton_decode_block_n: int | None = None
    triton_decode_num_warps: int | None = None  # None: 2 where a sequence gets one split of 64-key steps, else 4
    triton_decode_num_stages: int | None = None  # stage 1's key-loop pipelining; None: triton's default
    triton_decode_early_v: bool | None = None  # load each V block beside its K block; None: after the softmax
    triton_decode_prefetch_slots: bool | None = None  # each key block loads the next block's slots; None: on CUDA only
    # Layer 0 records the splits' slots, the others read them; None: on CUDA only.
    triton_decode_step_slots: bool | None = None
    triton_decode_stage2_pdl: bool | None = None  # stage 2 as stage 1's programmatic dependent; None: on CUDA 9.0+

    def validate(self) -> None:
        def fail(flag: str, why: str, value: object) -> None:
            raise ValueError(f"--{flag.replace('_', '-')} {why}, got {value!r}")

        if self.dtype not in DTYPES:
            fail("dtype", f"must be one of {', '.join(DTYPES)}", self.dtype)
        if self.device not in DEVICES:
            fail("device", f"must be one of {', '.join(DEVICES)}", self.device)
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}", self.attention_backend)
        GemvPdlRoles.parse(self.gemv_pdl_mode)  # raises naming the flag
        if self.gemv_rows is not None:
            GemvRowRoles.parse(self.gemv_rows)
        FusedMlpKnobs.parse(self.fused_mlp_config)
        GemvRowsKnobs.parse(self.gemv_rows_config)
        GemvBlockKnobs.parse(self.gemv_config)
        for name in ("triton_attention_num_kv_splits", "triton_decode_min_split_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                fail(name, "must be at least 1", getattr(self, name))
        block_n = self.triton_decode_block_n
        if block_n is not None and (block_n < 16 or block_n > 256 or block_n & (block_n - 1)):
            fail("triton_decode_block_n", "must be a power of two from 16 to 256", block_n)
        if self.triton_decode_num_warps not in (None, 1, 2, 4, 8, 16):
            fail("triton_decode_num_warps", "must be 1, 2, 4, 8 or 16", self.triton_decode_num_warps)
        if self.triton_decode_num_stages is not None and not 1 <= self.triton_decode_num_stages <= 8:
            fail("triton_decode_num_stages", "must be in 1..8", self.triton_decode_num_stages)
        if self.decode_attention_backend is not None and self.decode_attention_backend not in ATTENTION_BACKENDS:
            fail("decode_attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}",
                 self.decode_attention_backend)
        if self.context_length is not None and self.context_length < 2:
            fail("context_length", "must be at least 2", self.context_length)
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            fail("max_total_tokens", "must be at least 2", self.max_total_tokens)
        if not 0.0 < self.mem_fraction_static < 1.0:
            fail("mem_fraction_static", "must be in (0, 1)", self.mem_fraction_static)
        if not 1 <= self.page_size <= 256:
            fail("page_size", "must be in [1, 256]", self.page_size)
        if self.max_running_requests is not None and self.max_running_requests < 1:
            fail("max_running_requests", "must be at least 1", self.max_running_requests)
        if self.max_prefill_tokens < 1:
            fail("max_prefill_tokens", "must be at least 1", self.max_prefill_tokens)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            fail("chunked_prefill_size", "must be -1 (disabled) or at least 1", self.chunked_prefill_size)
        if self.stream_interval < 1:
            fail("stream_interval", "must be at least 1", self.stream_interval)
        if self.prefill_graph_max_tokens is not None and self.prefill_graph_max_tokens != 0 \
                and self.prefill_graph_max_tokens < MIN_PREFILL_GRAPH_TOKENS:
            fail("prefill_graph_max_tokens", f"must be 0 (off) or at least {MIN_PREFILL_GRAPH_TOKENS}",
                 self.prefill_graph_max_tokens)
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            fail("cuda_graph_max_bs", "must be at least 1 (--disable-cuda-graph turns graphs off)", self.cuda_graph_max_bs)
        if not 0.0 <= self.new_token_ratio <= 1.0:
            fail("new_token_ratio", "must be in [0, 1]", self.new_token_ratio)
