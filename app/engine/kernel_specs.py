"""The values of the structured kernel options (``--kernel-options``, app/engine/kernel_plan.py):
the PDL mode of each batch-1 gemv, the gemvs that run persistent, and the launch knobs of the
gemv and fused-MLP kernels, each a NamedTuple with a ``parse`` that raises ValueError naming the
option and listing what it takes.

Inside ``--kernel-options`` (a comma-separated list) a value's own list is joined with ``+``:
``gemv-rows=gate_up+lm_head``, ``gemv-pdl-mode=qkv=wait+down=late``; every parser here takes
``+`` and ``,`` alike, so ``GemvRowRoles.parse("gate_up,lm_head")`` works from code too.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from app.kernels.pdl_modes import GEMV_PDL_MODES

# gemv-pdl-mode's tuned modes, per role (measured on the H200 at batch 1: lab/notes/gpu_notes.md). They
# differ in down's only. With fused-mlp, down's mode is the MLP kernel's trigger: "wait" lets the
# next layer's qkv launch at the kernel's start, its programs resident and waiting when it ends,
# which pays up to MLP_EARLY_TRIGGER_MAX_HIDDEN only; the down gemv and the wider MLP kernels let
# the next kernel in after their loop ("late"). gemv-pdl-mode=auto picks one
# (kernel_plan.resolve_auto_pdl_mode).
DEFAULT_PDL_MODE = "qkv=wait,o=preload,gate_up=wait-late,down=wait,lm_head=wait"
PLAIN_MLP_PDL_MODE = "qkv=wait,o=preload,gate_up=wait-late,down=late,lm_head=wait"
MLP_EARLY_TRIGGER_MAX_HIDDEN = 2048


class GemvPdlRoles(NamedTuple):
    """The PDL mode of each gemv of a batch-1 decode step ("" = an ordinary launch), from
    ``gemv-pdl-mode``: one mode for all, or ``role=mode+...`` (roles not named: off). The best
    mode differs by role: a norm prologue loses with a preloaded tile, and the down projection
    after gate_up gains when gate_up lets it in late. With fused-mlp, down's mode says whether the MLP kernel lets qkv launch, at its programs'
    start (an early mode) or after their loop (a late one); gate_up's is unused: the kernel
    launches plainly."""

    qkv: str = ""
    o: str = ""
    gate_up: str = ""
    down: str = ""
    lm_head: str = ""

    @classmethod
    def parse(cls, spec: str, *, auto: str = DEFAULT_PDL_MODE) -> GemvPdlRoles:
        """``"wait"`` (every role), ``"off"`` (none), ``"qkv=wait+down=late"`` or ``"auto"``, which
        stands for ``auto`` (the plan passes the model's: kernel_plan.resolve_auto_pdl_mode);
        ValueError naming what is wrong."""
        spec = spec.strip()
        if spec == "auto":
            spec = auto
        if spec in GEMV_PDL_MODES:
            return cls(*(spec,) * len(cls._fields))
        if spec == "off":  # what spec() writes when every role is off
            return cls()
        roles: dict[str, str] = {}
        for item in _items(spec):
            role, sep, mode = (part.strip() for part in item.partition("="))
            if not sep or role not in cls._fields or mode not in GEMV_PDL_MODES + ("off",):
                raise ValueError(
                    f"gemv-pdl-mode takes auto, one of {', '.join(GEMV_PDL_MODES)} or role=mode pairs joined by "
                    f"'+' (roles {', '.join(cls._fields)}; modes those or off), got {spec!r}")
            if role in roles:
                raise ValueError(f"gemv-pdl-mode names {role} twice in {spec!r}")
            roles[role] = "" if mode == "off" else mode
        return cls(**roles)

    def spec(self) -> str:
        """The canonical spelling: one mode when all roles share it, else role=mode pairs."""
        if len(set(self)) == 1:
            return self[0] or "off"
        return ",".join(f"{role}={mode or 'off'}" for role, mode in zip(self._fields, self))


# The roles whose batch-1 gemv runs persistent by default (with triton-gemv): where the kernel won
# in the model on the H200.
DEFAULT_GEMV_ROWS = "gate_up,lm_head"


class GemvRowRoles(NamedTuple):
    """The gemv kernels of a batch-1 decode step that run persistent (``gemv-rows``:
    triton_gemv_rows.py, a few programs an SM walking row tiles, x computed once a program),
    from ``"off"``, ``"all"`` or roles joined by ``+`` (``"gate_up+down"``)."""

    qkv: bool = False
    o: bool = False
    gate_up: bool = False
    down: bool = False
    lm_head: bool = False

    @classmethod
    def parse(cls, spec: str) -> GemvRowRoles:
        """ValueError naming the option on anything else."""
        spec = spec.strip()
        if spec in ("off", ""):
            return cls()
        if spec == "all":
            return cls(*(True,) * len(cls._fields))
        roles = _items(spec)
        unknown = [role for role in roles if role not in cls._fields]
        if unknown or len(set(roles)) != len(roles):
            raise ValueError(f"gemv-rows takes off, all or distinct roles joined by '+' (of "
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


def _items(spec: str) -> list[str]:
    """The parts of a list written with ``+`` (inside --kernel-options) or ``,`` (from code)."""
    return [item.strip() for item in re.split(r"[+,]", spec)]


def _role_launches(spec: str, option: str, roles: tuple[str, ...], launch_cls: type) -> dict[str, Any]:
    """``role:name=value+...`` separated by ";" as ``{role: launch_cls(...)}``; ValueError naming ``option``."""
    usage = (f"{option} takes role:name=value+... separated by ';' (roles {', '.join(roles)}, each once; names "
             f"{', '.join(launch_cls._fields)}, each once a role; values positive whole numbers, block_n and block_k "
             f"powers of two, num_warps 1, 2, 4, 8 or 16), got {spec!r}")
    launches: dict[str, Any] = {}
    for part in filter(None, (chunk.strip() for chunk in spec.split(";"))):
        role, sep, pairs = (piece.strip() for piece in part.partition(":"))
        if not sep or role not in roles or role in launches:
            raise ValueError(usage)
        knobs: dict[str, int] = {}
        for item in filter(None, _items(pairs)):
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
    """``gemv-rows-config``: the persistent gemv's launch where it should differ from
    rows_config's tiling, by role (GemvRowRoles' names), from
    ``"lm_head:programs_per_sm=1+num_warps=8+num_stages=4;qkv:num_stages=4"``, for A/B runs
    through the engine without a code change."""

    qkv: RowLaunch = RowLaunch()
    o: RowLaunch = RowLaunch()
    gate_up: RowLaunch = RowLaunch()
    down: RowLaunch = RowLaunch()
    lm_head: RowLaunch = RowLaunch()

    @classmethod
    def parse(cls, spec: str) -> GemvRowsKnobs:
        """``""`` (none) or ``role:name=value+...`` separated by ";"; ValueError naming the option."""
        return cls(**_role_launches(spec, "gemv-rows-config", cls._fields, RowLaunch))

    def changed_roles(self) -> list[str]:
        """The roles whose launch the spec changes."""
        return [role for role, launch in zip(self._fields, self) if launch.changes()]


class GemvBlockKnobs(NamedTuple):
    """``gemv-config``: the row-block gemv's launch (the kernel of the roles that do not run
    persistent) where it should differ from default_config's, by role, from
    ``"qkv:num_stages=2;o:block_k=2048+num_warps=8"``, for A/B runs through the engine without a
    code change."""

    qkv: BlockLaunch = BlockLaunch()
    o: BlockLaunch = BlockLaunch()
    gate_up: BlockLaunch = BlockLaunch()
    down: BlockLaunch = BlockLaunch()
    lm_head: BlockLaunch = BlockLaunch()

    @classmethod
    def parse(cls, spec: str) -> GemvBlockKnobs:
        """``""`` (none) or ``role:name=value+...`` separated by ";"; ValueError naming the option."""
        return cls(**_role_launches(spec, "gemv-config", cls._fields, BlockLaunch))

    def changed_roles(self) -> list[str]:
        """The roles whose launch the spec changes."""
        return [role for role, launch in zip(self._fields, self) if launch.changes()]


class FusedMlpKnobs(NamedTuple):
    """``fused-mlp-config``: launch knobs of the batch-1 MLP kernel that differ from its tuned
    defaults (triton_fused_mlp.FusedMlpConfig, whose fields these are; None: the default), from
    ``"block_n=8+num_warps=8+early_tile=1"``, for A/B runs through the engine without a code change."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    programs_per_sm: int | None = None
    programs: int | None = None
    early_tile: bool | None = None

    @classmethod
    def parse(cls, spec: str) -> FusedMlpKnobs:
        """``""`` (the defaults) or ``name=value`` pairs joined by ``+``; ValueError naming the option."""
        knobs: dict[str, int | bool] = {}
        for item in filter(None, _items(spec)):
            name, sep, value = (part.strip() for part in item.partition("="))
            if not sep or name not in cls._fields or name in knobs or not value.isdigit():
                raise ValueError(f"fused-mlp-config takes name=value pairs joined by '+' (names "
                                 f"{', '.join(cls._fields)}, each once; values whole numbers), got {spec!r}")
            knobs[name] = bool(int(value)) if name == "early_tile" else int(value)
        return cls(**knobs)

    def changes(self) -> dict[str, int | bool]:
        """The knobs given, as FusedMlpConfig._replace takes them."""
        return {name: value for name, value in zip(self._fields, self) if value is not None}
