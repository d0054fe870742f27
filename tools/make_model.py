"""Write a random-weight Hugging Face checkpoint: a preset with a real model's exact shapes, or any
shape given by flags (flags override the preset's fields).

    python tools/make_model.py /data/llama-8b --preset llama-3.1-8b
    python tools/make_model.py /tmp/small --preset qwen3-0.6b --layers 2 --dtype float32

The output is gibberish: the weights are random. The tokenizer is the built-in 1024-token one,
whatever the preset, while the model keeps the real vocabulary size; so a big preset mostly samples
ids the tokenizer has no text for (they decode to nothing): benchmark with token counts.
Writing is streamed (memory stays under a few hundred MB): llama-3.1-8b took 58 s on 16 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from app.engine.make_checkpoint import (
    ARCHITECTURES,
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    PRESETS,
    Llama3RopeScaling,
    ModelSpec,
    make_checkpoint,
    plan_checkpoint,
)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a plain number of bytes."""
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGIB")
    unit = stripped[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 5GB, 500MB, 2GiB)") from None
    if unit not in _UNITS or value <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 5GB, 500MB, 2GiB)")
    return int(value * _UNITS[unit])


def _describe(name: str, spec: ModelSpec) -> str:
    plan = plan_checkpoint(spec)
    heads = f"{spec.num_heads}/{spec.num_kv_heads}x{spec.resolved_head_dim}"
    tied = ", tied" if spec.tie_word_embeddings else ""
    n = plan.num_parameters
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"
    return (f"  {name:<13} {spec.architecture:<17} {size:>6}  layers {spec.num_layers}, "
            f"hidden {spec.hidden_size}, ffn {spec.intermediate_size}, heads {heads}, vocab {spec.vocab_size}{tied}, "
            f"{spec.dtype}")


def build_parser() -> argparse.ArgumentParser:
    presets = "\n".join(_describe(name, spec) for name, spec in PRESETS.items())
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"presets (heads = query/kv x head_dim):\n{presets}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", type=Path, help="directory to create (must be absent or empty)")
    parser.add_argument("--preset", default="tiny-llama", choices=list(PRESETS), help="starting shape (default: tiny-llama)")
    parser.add_argument("--arch", choices=list(ARCHITECTURES), help="architecture")
    parser.add_argument("--layers", type=int, help="number of decoder layers")
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--intermediate-size", type=int, help="MLP width")
    parser.add_argument("--heads", type=int, help="query heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (GQA)")
    parser.add_argument("--head-dim", type=int, help="per-head size (default: hidden size / heads)")
    parser.add_argument("--vocab-size", type=int, help="embedding rows (at least the tokenizer's 1024)")
    parser.add_argument("--max-position-embeddings", type=int)
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--rope-scaling-factor", type=float,
                        help="llama3 rope scaling with this factor (original context: --rope-original-max)")
    parser.add_argument("--rope-original-max", type=int, default=8192,
                        help="original_max_position_embeddings of llama3 rope scaling (default 8192)")
    parser.add_argument("--no-rope-scaling", action="store_true", help="plain rotary, even if the preset scales")
    parser.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--rms-norm-eps", type=float)
    parser.add_argument("--dtype", choices=list(DTYPES))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_SIZE,
                        help="split model.safetensors into files of at most this size (default 5GB)")
    return parser


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """The preset with every given flag applied; ValueError (naming the field) if inconsistent."""
    spec = PRESETS[args.preset]
    changes = {
        field: value
        for field, value in (
            ("architecture", args.arch), ("num_layers", args.layers), ("hidden_size", args.hidden_size),
            ("intermediate_size", args.intermediate_size), ("num_heads", args.heads),
            ("num_kv_heads", args.kv_heads), ("head_dim", args.head_dim), ("vocab_size", args.vocab_size),
            ("max_position_embeddings", args.max_position_embeddings), ("rope_theta", args.rope_theta),
            ("tie_word_embeddings", args.tie_word_embeddings), ("rms_norm_eps", args.rms_norm_eps),
            ("dtype", args.dtype), ("seed", args.seed),
        )
        if value is not None
    }
    # A preset's head_dim belongs to its shape: a new width or head count recomputes it.
    if args.head_dim is None and (args.hidden_size is not None or args.heads is not None):
        changes["head_dim"] = None
    if args.no_rope_scaling:
        changes["rope_scaling"] = None
    elif args.rope_scaling_factor is not None:
        changes["rope_scaling"] = Llama3RopeScaling(
            factor=args.rope_scaling_factor, original_max_position_embeddings=args.rope_original_max
        )
    return spec.replace(**changes)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    plan = plan_checkpoint(spec, args.max_shard_size)
    print(f"writing {plan.num_parameters / 1e9:.3f}B parameters ({plan.total_size / 1e9:.2f} GB, "
          f"{len(plan.shards)} file(s)) to {args.out_dir}", file=sys.stderr)
    start = time.monotonic()
    try:
        make_checkpoint(args.out_dir, spec, max_shard_size=args.max_shard_size,
                        progress=lambda line: print(line, file=sys.stderr))
    except FileExistsError as exc:
        parser.error(str(exc))
    print(f"done in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
