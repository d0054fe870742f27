"""Baseline: the same workload through transformers' ``generate`` (greedy, exact lengths).

    python tools/bench_hf.py --model-path DIR [--num-prompts 256] [--input-len 512] [--output-len 128]

Prompts are the same random token ids as tools/bench_offline.py draws (same seed), all of one
length, so the batch needs no padding; ``min_new_tokens = max_new_tokens`` makes every request
produce exactly --output-len tokens (the ``ignore_eos`` of our benchmark). The whole batch goes
to one ``generate`` call (transformers has no continuous batching). The last line printed is
one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this baseline runs on a CUDA device")

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=getattr(torch, options.dtype)).cuda().eval()
    vocab = model.config.vocab_size
    rng = random.Random(options.seed)
    prompts = [[rng.randrange(vocab) for _ in range(options.input_len)] for _ in range(options.num_prompts)]
    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)
    n = options.output_len

    def generate(batch: torch.Tensor, attention: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return model.generate(
            input_ids=batch, attention_mask=attention, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )

    with torch.inference_mode():
        generate(ids[:1, :16], mask[:1, :16], 4)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(ids, mask, n)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - options.input_len) * out.shape[0]
    print(json.dumps({
        "engine": "transformers.generate",
        "num_prompts": options.num_prompts,
        "input_len": options.input_len,
        "output_len": n,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(produced / elapsed, 1),
        "total_tokens_per_s": round((produced + options.num_prompts * options.input_len) / elapsed, 1),
    }))


if __name__ == "__main__":
    main()
