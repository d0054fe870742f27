"""Our forward pass over the paged KV cache against transformers' own, on tiny random checkpoints.

Every comparison is teacher-forced: the same token ids go through both models and the logits must
agree within TOL relative to the logit scale (float32 on CPU; batched matmuls differ in last bits).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from app.engine.model_config import ARCHITECTURES, ModelConfig
from app.engine.models import MODEL_CLASSES, CausalLM
from app.engine.weights import load_model
from app.engine.attention.torch_backend import TorchAttentionBackend

TOL = 1e-4
PROMPT_LENS = (1, 2, 7, 15, 16, 17, 33, 48)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL * scale, f"max abs diff {diff:.3g} > {TOL} * {scale:.3g}"


def make_prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


@dataclass
class Engine:
    """The minimal pieces a scheduler holds: model, slot allocator, KV pool, request table, backend."""

    model: CausalLM
    allocator: SlotAllocator
    req_pool: ReqToTokenPool
    backend: TorchAttentionBackend

    @classmethod
    def load(cls, model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
             max_total_tokens: int = 1024) -> Engine:
        model = load_model(model_dir, dtype=dtype, device=device)
        cfg = model.config
        allocator = SlotAllocator(max_total_tokens, device=device)
        kv_pool = KVPool.for_model(cfg, num_slots=allocator.num_slots, dtype=dtype, device=device)
        req_pool = ReqToTokenPool(16, cfg.max_context_len, device=device)
        return cls(model, allocator, req_pool, TorchAttentionBackend(kv_pool, req_pool))

    def step(self, mode: ForwardMode, rows: list[int], prefix_lens: list[int], new_tokens: list[list[int]],
             *, all_logits: bool = False) -> torch.Tensor:
        extend_lens = [len(t) for t in new_tokens]
        slots = self.allocator.alloc(sum(extend_lens))
        assert slots is not None
        batch = ForwardBatch.build(mode=mode, req_pool_indices=rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
                                   out_cache_loc=slots, req_to_token_pool=self.req_pool, attn_backend=self.backend)
        input_ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64, device=slots.device)
        with torch.inference_mode():
            return self.model(input_ids, batch.positions, batch, all_logits=all_logits).cpu()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Where our model runs; the reference always runs on the CPU."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return request.param


@pytest.fixture(scope="module")
def reference() -> Callable[[Path, list[int]], torch.Tensor]:
    """transformers' float32 logits ``[len, vocab]`` for one token sequence (models cached per dir)."""
    from transformers import AutoModelForCausalLM

    models: dict[Path, torch.nn.Module] = {}

    def logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
        if model_dir not in models:
            models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[model_dir](torch.tensor([ids])).logits[0].float()

    return logits


def test_config_matches_transformers(checkpoint: Path) -> None:
    from transformers import AutoConfig

    ours, theirs = ModelConfig.from_pretrained(checkpoint), AutoConfig.from_pretrained(checkpoint)
    assert ours.architecture == theirs.architectures[0]
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.vocab_size) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads,
        theirs.vocab_size)
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


def test_one_extend_batch(checkpoint: Path, reference: Callable, device: str) -> None:
    engine = Engine.load(checkpoint, device=device)
    prompts = make_prompts(engine.model.config.vocab_size)
    rows = engine.req_pool.alloc(len(prompts))
    logits = engine.step(ForwardMode.EXTEND, rows, [0] * len(prompts), prompts, all_logits=True)
    for prompt, ours in zip(prompts, logits.split([len(p) for p in prompts])):
        assert_close(ours, reference(checkpoint, prompt))
    # Default output: the last token's logits of each sequence, the same numbers, with the last
    # layer's o_proj and MLP run on those rows alone (every other layer's on all the tokens).
    engine2 = Engine.load(checkpoint, device=device)
    rows_seen: list[tuple[int, int]] = []
    hooks = [layer.mlp.register_forward_hook(lambda _m, args, _o, i=i: rows_seen.append((i, args[0].shape[0])))
             for i, layer in enumerate(engine2.model.layers)]
    last = engine2.step(ForwardMode.EXTEND, engine2.req_pool.alloc(len(prompts)), [0] * len(prompts), prompts)
    for hook in hooks:
        hook.remove()
    ends = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    assert_close(last, logits[ends])
    num_layers = len(engine2.model.layers)
    assert rows_seen == [(i, sum(PROMPT_LENS)) for i in range(num_layers - 1)] + [(num_layers - 1, len(prompts))]


def test_chunked_prefill_over_fragmented_slots(checkpoint: Path, reference: Callable, device: str) -> None:
    """Prompts prefilled 16 tokens per step on top of their cached chunks, in scattered slots."""
    engine = Engine.load(checkpoint, device=device)
    hole_punch = engine.allocator.alloc(400)
    engine.allocator.free(hole_punch[::2])  # the next allocations interleave with held slots
    prompts = make_prompts(engine.model.config.vocab_size, seed=1)
    rows = engine.req_pool.alloc(len(prompts))
    done = [0] * len(prompts)
    outputs: list[list[torch.Tensor]] = [[] for _ in prompts]
    while active := [i for i, p in enumerate(prompts) if done[i] < len(p)]:
        chunks = [prompts[i][done[i] : done[i] + 16] for i in active]
        logits = engine.step(ForwardMode.EXTEND, [rows[i] for i in active], [done[i] for i in active], chunks,
                             all_logits=True)
        for i, chunk, out in zip(active, chunks, logits.split([len(c) for c in chunks])):
            outputs[i].append(out)
            done[i] += len(chunk)
    for prompt, outs in zip(prompts, outputs):
        assert_close(torch.cat(outs), reference(checkpoint, prompt))


def test_decode_after_prefill(checkpoint: Path, reference: Callable, device: str) -> None:
    engine = Engine.load(checkpoint, device=device)
    vocab = engine.model.config.vocab_size
    prompts = make_prompts(vocab, seed=2)
    continuations = make_prompts(vocab, lens=(5,) * len(prompts), seed=3)
    rows = engine.req_pool.alloc(len(prompts))
    steps = [engine.step(ForwardMode.EXTEND, rows, [0] * len(prompts), prompts)]
    for j in range(5):
        steps.append(engine.step(ForwardMode.DECODE, rows, [len(p) + j for p in prompts],
                                 [[c[j]] for c in continuations]))
    for b, (prompt, cont) in enumerate(zip(prompts, continuations)):
        ref = reference(checkpoint, prompt + cont)
        ours = torch.stack([s[b] for s in steps])  # logits at positions len-1 ... len+4
        assert_close(ours, ref[len(prompt) - 1 : len(prompt) + 5])


def test_logits_out_is_written_in_place(checkpoint: Path, device: str) -> None:
    """``logits_out`` (a decode graph's static buffer): the same logits, written into the buffer
    and returned as it, for a decode batch of several rows (torch's matmul into the buffer) and
    of one; asked for with float32 conversion, a clear error."""
    engine = Engine.load(checkpoint, device=device)
    vocab = engine.model.config.vocab_size
    prompts = make_prompts(vocab, seed=4)
    rows = engine.req_pool.alloc(len(prompts))
    engine.step(ForwardMode.EXTEND, rows, [0] * len(prompts), prompts)
    for count in (len(prompts), 1):
        slots = engine.allocator.alloc(count)
        assert slots is not None
        batch = ForwardBatch.build(mode=ForwardMode.DECODE, req_pool_indices=rows[:count],
                                   prefix_lens=[len(p) for p in prompts[:count]], extend_lens=[1] * count,
                                   out_cache_loc=slots, req_to_token_pool=engine.req_pool, attn_backend=engine.backend)
        ids = torch.arange(7, 7 + count, device=slots.device)
        buffer = torch.full((count + 2, vocab), float("nan"), device=slots.device)[:count]
        with torch.inference_mode():
            expected = engine.model(ids, batch.positions, batch, float_logits=False)
            got = engine.model(ids, batch.positions, batch, float_logits=False, logits_out=buffer)
            with pytest.raises(ValueError, match="logits_out: the logits stay in the model dtype"):
                engine.model(ids, batch.positions, batch, logits_out=buffer)
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, expected)


def test_shared_prefix_through_request_table(checkpoint: Path, reference: Callable, device: str) -> None:
    """A second request reuses the first one's prefix slots (as the radix cache will arrange)."""
    engine = Engine.load(checkpoint, device=device)
    vocab = engine.model.config.vocab_size
    first, tail = make_prompts(vocab, lens=(30, 11), seed=4)
    second = first[:20] + tail
    row_a, row_b = engine.req_pool.alloc(2)
    engine.step(ForwardMode.EXTEND, [row_a], [0], [first])
    engine.req_pool.req_to_token[row_b, :20] = engine.req_pool.req_to_token[row_a, :20]
    logits = engine.step(ForwardMode.EXTEND, [row_b], [20], [tail], all_logits=True)
    assert_close(logits, reference(checkpoint, second)[20:])


def test_sharded_checkpoint(make_checkpoint: Callable[..., Path], reference: Callable) -> None:
    model_dir = make_checkpoint("qwen3", max_shard_size="40KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 2 and (model_dir / "model.safetensors.index.json").is_file()
    engine = Engine.load(model_dir)
    prompt = make_prompts(engine.model.config.vocab_size, lens=(12,))[0]
    logits = engine.step(ForwardMode.EXTEND, engine.req_pool.alloc(1), [0], [prompt], all_logits=True)
    assert_close(logits, reference(model_dir, prompt))


def test_bfloat16_runs_close_to_float32(make_checkpoint: Callable[..., Path], device: str) -> None:
    model_dir = make_checkpoint("llama-tied-llama3")
    prompts = make_prompts(384, lens=(9, 20))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine.load(model_dir, dtype=dtype, device=device)
        assert engine.model.embed_tokens.weight.dtype == dtype
        results.append(engine.step(ForwardMode.EXTEND, engine.req_pool.alloc(2), [0, 0], prompts))
    assert results[1].dtype == torch.float32
    assert (results[1] - results[0]).abs().max() < 0.1 * results[0].abs().max()


def _tiny_backend(max_context_len: int = 16) -> tuple[ReqToTokenPool, TorchAttentionBackend]:
    req_pool = ReqToTokenPool(4, max_context_len)
    kv_pool = KVPool(num_slots=64, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    return req_pool, TorchAttentionBackend(kv_pool, req_pool)


def test_forward_batch_layout() -> None:
    """The example of the forward_batch module docstring."""
    req_pool, backend = _tiny_backend()
    slots = torch.arange(10, 17)
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, req_pool_indices=[2, 0, 1], prefix_lens=[3, 0, 5],
                               extend_lens=[2, 4, 1], out_cache_loc=slots, req_to_token_pool=req_pool,
                               attn_backend=backend)
    assert batch.positions.tolist() == [3, 4, 0, 1, 2, 3, 5]
    assert batch.last_token_indices.tolist() == [1, 5, 6]
    assert batch.seq_lens.tolist() == [5, 4, 6] and batch.seq_lens_cpu == (5, 4, 6)
    assert (batch.batch_size, batch.num_tokens) == (3, 7)
    table = req_pool.req_to_token
    assert table[2, 3:5].tolist() == [10, 11] and table[0, :4].tolist() == [12, 13, 14, 15]
    assert table[1, 5].item() == 16


@pytest.mark.parametrize(
    ("mode", "prefix_lens", "extend_lens", "num_slots", "message"),
    [
        (ForwardMode.DECODE, [3], [2], 2, "DECODE extends each sequence by 1"),
        (ForwardMode.EXTEND, [3], [2], 3, r"out_cache_loc must have shape \(2,\)"),
        (ForwardMode.EXTEND, [15], [2], 2, "exceeds max_context_len 16"),
        (ForwardMode.EXTEND, [0], [0], 0, "extend_lens must be >= 1"),
        (ForwardMode.EXTEND, [0, 0], [1], 1, "one prefix_len and extend_len per request"),
    ],
)
def test_forward_batch_rejects_inconsistent_steps(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], num_slots: int, message: str
) -> None:
    req_pool, backend = _tiny_backend()
    with pytest.raises(ValueError, match=message):
        ForwardBatch.build(mode=mode, req_pool_indices=[0], prefix_lens=prefix_lens, extend_lens=extend_lens,
                           out_cache_loc=torch.arange(1, 1 + num_slots), req_to_token_pool=req_pool,
                           attn_backend=backend)


# -- load errors name the file and the tensor ---------------------------------------------------


@pytest.fixture
def llama_dir(make_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of a checkpoint, free to be damaged."""
    return Path(shutil.copytree(make_checkpoint("llama-untied-bias"), tmp_path / "ckpt"))


def _edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_missing_tensor_is_named(llama_dir: Path) -> None:
    path = llama_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' of shape \(128, 64\)"):
        load_model(llama_dir)


def test_missing_tensor_in_shard_names_the_shard(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint("qwen2", max_shard_size="40KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.k_proj.bias"
    shard = model_dir / index[name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=rf"{index[name]} \(per model.safetensors.index.json\): missing tensor '{name}'"):
        load_model(model_dir)


def test_missing_shard_file_is_named(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint("qwen2", max_shard_size="40KB")
    shard = sorted(model_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard.name}: missing file"):
        load_model(model_dir)


def test_unexpected_tensor_is_named(llama_dir: Path) -> None:
    path = llama_dir / "model.safetensors"
    tensors = load_file(path) | {"model.layers.0.self_attn.extra.weight": torch.zeros(2, 2)}
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight' with shape \(2, 2\)"):
        load_model(llama_dir)


def test_shape_mismatch_names_both_shapes(llama_dir: Path) -> None:
    _edit_config(llama_dir, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \(\d+, \d+\), but config\.json implies \(\d+, \d+\)"):
        load_model(llama_dir)


def test_no_weights_is_named(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(llama_dir)


def test_unknown_architecture_is_named(llama_dir: Path) -> None:
    _edit_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"config\.json: architectures: unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM, .*Qwen3ForCausalLM"):
        load_model(llama_dir)


# -- config parsing ------------------------------------------------------------------------------

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 2048}


def test_registry_covers_every_architecture() -> None:
    assert set(MODEL_CLASSES) == set(ARCHITECTURES)


def test_config_defaults_and_derived_fields() -> None:
    cfg = ModelConfig.from_dict(BASE | {"num_key_value_heads": None, "head_dim": None})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.dtype) == (4, 16, 10000.0, None, "float32")
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.tie_word_embeddings)
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]


def test_config_transformers4_rope_fields() -> None:
    """transformers 4.x: rope_theta at top level, rope_scaling with ``type`` or ``rope_type``."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for key in ("rope_type", "type"):
        cfg = ModelConfig.from_dict(BASE | {"rope_theta": 500000.0, "rope_scaling": scaling | {key: "llama3"},
                                            "torch_dtype": "bfloat16"})
        assert cfg.rope_theta == 500000.0 and cfg.dtype == "bfloat16"
        assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"
        assert cfg.rope_scaling.original_max_position_embeddings == 8192


def test_config_architecture_flags() -> None:
    qwen2 = ModelConfig.from_dict(BASE | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.sliding_window) == (True, False, False, None)
    qwen3 = ModelConfig.from_dict(BASE | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128})
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim, qwen3.q_size) == (False, True, 128, 512)
    mistral = ModelConfig.from_dict(BASE | {"architectures": ["MistralForCausalLM"], "sliding_window": 1024})
    assert mistral.max_context_len == 1024


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide"),
        ({"hidden_size": 65}, "hidden_size: 65 is not a multiple"),
        ({"vocab_size": 0}, "vocab_size: must be >= 1"),
        ({"intermediate_size": "big"}, "intermediate_size: expected an integer"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor: missing"),
        ({"dtype": "int8"}, "dtype: unsupported dtype 'int8'"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
        ({"architectures": []}, "architectures: expected a list of one name"),
    ],
)
def test_config_errors_name_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^config.json: .*{message}"):
        ModelConfig.from_dict(BASE | changes)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
