"""How many tokens of KV cache a GPU holds: pure arithmetic over measured figures (bytes).

The builder loads the weights, runs one profiling forward of the largest prefill step the
scheduler can issue (on a tiny temporary pool), frees it, and then reads the device's figures.
What is left of our share of the device becomes the KV pool::

    share   = total × mem_fraction_static        our part of the device; the rest stays free
    budget  = share
            − used                               in use now (total − free): weights, CUDA context,
                                                 library workspaces, other processes
            − activation_peak                    profiled growth of the largest prefill step
                                                 (incl. the attention backend's workspace)
            − reserve                            CUDA graphs (pool + logits buffer), sampling
                                                 workspace, request table (see reserve_bytes)
    tokens  = budget // bytes_per_token − page_size     the pool also holds the reserved page 0
    tokens  = tokens rounded down to whole pages

    bytes_per_token = K and V of every layer (kv_bytes_per_token) + INDEX_BYTES_PER_TOKEN

For example, an H200 (141 GiB) at 0.85 serving Llama-3.1-8B in bf16 (15.0 GiB of weights,
16.0 GiB in use, 1.5 GiB activation peak, 1.2 GiB reserve, 131072 + 17 bytes a token)::

    budget = 119.85 − 16.0 − 1.5 − 1.2 = 101.15 GiB  ->  101.15 GiB // 131089 B − 1 = 828,512 tokens

Too little memory is an error at start, never a crash later: the functions here raise
ValueError naming the flags that change the outcome, with the figures.
"""

from __future__ import annotations

from typing import NamedTuple

GIB = 1 << 30
FLOAT32_BYTES = 4
INT32_BYTES = 4
# Per token of pool, besides its K and V: the slot allocator's free-list entry (int64) and flag
# (bool) per page, and the radix cache's slot id (int64) of a cached token.
INDEX_BYTES_PER_TOKEN = 8 + 1 + 8
# Float32 [max_running, vocab] arrays alive at once while a step samples: the logits, their
# log-softmax, the penalty tables (counts, seen), and the temporaries of penalties, softmax,
# sort (values and int64 indices) and cumsum.
SAMPLING_TEMPORARIES = 8
# The CUDA graphs' shared memory pool, as a multiple of one eager decode step's peak of the
# largest graph batch: all sizes are captured into one pool (largest first), whose blocks
# fragment over the captures.
GRAPH_POOL_FACTOR = 2
# Per captured size: the instantiated graph itself and what a backend keeps per size (e.g.
# flashinfer's plan workspace of a graph wrapper, 8 MiB).
GRAPH_BYTES_PER_SIZE = 16 << 20


def gib(n: float) -> float:
    return n / GIB


class Reserve(NamedTuple):
    """Memory the pool must leave for what is allocated after it, or per step, in bytes."""

    graphs: int  # CUDA graphs' pool and their logits buffer (0 without graphs)
    sampling: int  # sampling workspace of a full decode batch
    table: int  # the request table (ReqToTokenPool), int32 [max_running, context_len]

    @property
    def total(self) -> int:
        return self.graphs + self.sampling + self.table


def reserve_bytes(
    *,
    vocab_size: int,
    max_running: int,
    context_len: int,
    graph_sizes: int = 0,
    graph_max_bs: int = 0,
    graph_step_peak: int = 0,
    graph_state: int = 0,
) -> Reserve:
    """What to keep free besides the weights, the activations and the pool.

    ``graph_sizes``: how many decode batch sizes are captured, the largest ``graph_max_bs`` (0:
    no graphs); ``graph_step_peak``: the profiled peak of one eager decode step of that many
    sequences; ``graph_state``: what the attention backend's ``init_cuda_graph_state`` allocated::

        graphs   = graph_step_peak × GRAPH_POOL_FACTOR + graph_state
                 + graph_sizes × GRAPH_BYTES_PER_SIZE + graph_max_bs × vocab × 4   (logits buffer)
        sampling = SAMPLING_TEMPORARIES × max_running × vocab × 4
        table    = max_running × context_len × 4
    """
    graphs = 0
    if graph_sizes:
        graphs = (graph_step_peak * GRAPH_POOL_FACTOR + graph_state + graph_sizes * GRAPH_BYTES_PER_SIZE
                  + graph_max_bs * vocab_size * FLOAT32_BYTES)
    sampling = SAMPLING_TEMPORARIES * max_running * vocab_size * FLOAT32_BYTES
    table = max_running * context_len * INT32_BYTES
    return Reserve(graphs, sampling, table)


def pool_bytes(tokens: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Device bytes of a pool of ``tokens`` usable slots (plus the reserved page)."""
    return (tokens + page_size) * bytes_per_token


def kv_pool_tokens(
    *,
    total: int,
    used: int,
    activation_peak: int,
    reserve: int,
    bytes_per_token: int,
    mem_fraction_static: float,
    context_len: int,
    page_size: int = 1,
    max_total_tokens: int | None = None,
    weights: int | None = None,
) -> int:
    """Usable tokens of the KV pool (a multiple of ``page_size``); see the module docstring.

    ``max_total_tokens`` (the flag, when given) is checked instead: its pool must fit in what is
    free after what is in use, the activations and the reserve (--mem-fraction-static does not
    apply). ``weights`` (part of ``used``) only goes into messages.

    Raises ValueError naming the flags: when the budget holds fewer tokens than one request of
    ``context_len`` (or than two pages), or when an explicit pool does not fit.
    """
    if bytes_per_token < 1 or page_size < 1:
        raise ValueError(f"kv_pool_tokens: bytes_per_token ({bytes_per_token}) and page_size ({page_size}) must be >= 1")
    in_use = f"{gib(used):.2f} GiB in use" + (f" (weights {gib(weights):.2f} GiB)" if weights is not None else "")
    others = f"{gib(activation_peak):.2f} GiB activation peak, {gib(reserve):.2f} GiB for CUDA graphs, sampling and the request table"
    if max_total_tokens is not None:
        tokens = max_total_tokens - max_total_tokens % page_size
        free = total - used - activation_peak - reserve
        need = pool_bytes(tokens, bytes_per_token, page_size)
        if need > free:
            fits = _whole_pages(free // bytes_per_token - page_size, page_size)
            raise ValueError(
                f"--max-total-tokens {max_total_tokens} needs {gib(need):.2f} GiB of KV cache "
                f"({bytes_per_token} bytes a token) but only {gib(free):.2f} GiB is free on the device "
                f"({gib(total):.2f} GiB, {in_use}, {others}); at most {max(fits, 0)} tokens fit: "
                "lower --max-total-tokens (or leave it out to size the pool from --mem-fraction-static), "
                "--chunked-prefill-size or --context-length"
            )
        return tokens
    share = int(total * mem_fraction_static)
    budget = share - used - activation_peak - reserve
    tokens = _whole_pages(budget // bytes_per_token - page_size, page_size)
    need = max(2 * page_size, -(-context_len // page_size) * page_size)
    if tokens < need:
        raise ValueError(
            f"--mem-fraction-static {mem_fraction_static} leaves {gib(budget):.2f} GiB for the KV cache "
            f"({max(tokens, 0)} tokens of {bytes_per_token} bytes): {gib(share):.2f} GiB of {gib(total):.2f} GiB, "
            f"less {in_use}, {others}; one request of --context-length {context_len} needs {need} tokens "
            f"({gib(pool_bytes(need, bytes_per_token, page_size)):.2f} GiB). Raise --mem-fraction-static, "
            "lower --context-length, --chunked-prefill-size or --max-running-requests, "
            "or give a smaller --max-total-tokens"
        )
    return tokens


def check_step_headroom(*, free: int, activation_peak: int, sampling: int, prefill_tokens: int) -> None:
    """After the pool is allocated and the CUDA graphs captured, what is still free must hold a
    step: the largest prefill's activations and the sampling workspace. Raises ValueError (a
    shortfall here would be an out-of-memory crash on the first large batch)."""
    need = activation_peak + sampling
    if free < need:
        raise ValueError(
            f"after the KV cache and the CUDA graphs only {gib(free):.2f} GiB of device memory is free, less than "
            f"the {gib(need):.2f} GiB that a prefill step of {prefill_tokens} tokens ({gib(activation_peak):.2f} GiB) "
            f"and sampling ({gib(sampling):.2f} GiB) need: lower --mem-fraction-static or --max-total-tokens, "
            "--cuda-graph-max-bs (or --disable-cuda-graph), or --chunked-prefill-size"
        )


def weights_do_not_fit(weights: int, total: int, free: int, dtype: str) -> str:
    """The start-up error when the model's weights do not fit on the device."""
    smaller = " (e.g. --dtype bfloat16)" if dtype == "float32" else ""
    return (
        f"the model's weights need {gib(weights):.2f} GiB in {dtype} but the device has "
        f"{gib(free):.2f} GiB free of {gib(total):.2f} GiB ({gib(total - free):.2f} GiB used by this or other "
        f"processes): try a smaller --dtype{smaller}, another device with more free memory "
        "(CUDA_VISIBLE_DEVICES) or a smaller model; --mem-fraction-static only divides what is left after "
        "the weights, so raising it does not help"
    )


def _whole_pages(tokens: int, page_size: int) -> int:
    return tokens - tokens % page_size if tokens > 0 else tokens
