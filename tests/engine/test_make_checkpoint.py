"""Random-weight checkpoints: deterministic bytes, loadable by transformers, real preset shapes,
bounded memory, and a default model cache that survives concurrent first use."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import app.engine.make_checkpoint as mc
from app.text import Tokenizer

REPO = Path(__file__).resolve().parents[2]
TINY_PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")


def _hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=REPO)


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    return {name: mc.make_checkpoint(root / name, mc.PRESETS[name]) for name in TINY_PRESETS}


# ---------------------------------------------------------------- determinism


def test_builds_are_byte_identical_across_processes(tmp_path: Path) -> None:
    here = mc.make_checkpoint(tmp_path / "here")
    result = _run_python("import sys, app.engine.make_checkpoint as mc; mc.make_checkpoint(sys.argv[1])",
                         str(tmp_path / "there"))
    assert result.returncode == 0, result.stderr
    assert _hashes(here) == _hashes(tmp_path / "there")
    assert set(_hashes(here)) == {
        mc.MANIFEST_FILE, "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    }


def test_seed_changes_the_weights_only(tmp_path: Path) -> None:
    a = mc.make_checkpoint(tmp_path / "a")
    b = mc.make_checkpoint(tmp_path / "b", mc.TINY_LLAMA.replace(seed=1))
    ha, hb = _hashes(a), _hashes(b)
    assert ha["tokenizer.json"] == hb["tokenizer.json"] and ha["config.json"] == hb["config.json"]
    assert ha["model.safetensors"] != hb["model.safetensors"]


def test_sharding_and_dtype_do_not_change_the_values(tmp_path: Path) -> None:
    single = mc.make_checkpoint(tmp_path / "single")
    sharded = mc.make_checkpoint(tmp_path / "sharded", max_shard_size=600_000)
    bf16 = mc.make_checkpoint(tmp_path / "bf16", mc.TINY_LLAMA.replace(dtype="bfloat16"))

    index = json.loads((sharded / mc.INDEX_FILE).read_text())
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    reference = _tensors(single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    for shard in sharded.glob("*.safetensors"):
        # Only an oversized tensor may exceed the limit, and then it is alone in its file.
        with safe_open(str(shard), "pt") as f:
            names = list(f.keys())
            assert sum(f.get_tensor(n).numel() * 4 for n in names) <= 600_000 or len(names) == 1

    for name, tensor in _tensors(sharded).items():
        assert torch.equal(tensor, reference[name]), name
    for name, tensor in _tensors(bf16).items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_weights_have_the_requested_statistics(tiny_checkpoints: dict[str, Path]) -> None:
    tensors = _tensors(tiny_checkpoints["tiny-qwen2"])
    embed = tensors["model.embed_tokens.weight"]
    assert embed.shape == (mc.PRESETS["tiny-qwen2"].vocab_size, 128)
    assert abs(embed.std().item() - 0.02) < 0.001 and abs(embed.mean().item()) < 0.001
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.05 < norm.std().item() < 0.15
    assert tensors["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0


# ---------------------------------------------------------------- transformers loads them


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_transformers_loads_model_and_tokenizer(tiny_checkpoints: dict[str, Path], preset: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_checkpoints[preset]
    spec = mc.PRESETS[preset]
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True, dtype=torch.float32)
    assert type(model).__name__ == spec.architecture
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = model.state_dict()
    for name, tensor in _tensors(model_dir).items():
        assert torch.equal(state[name], tensor), name
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    prompt = "The quick brown fox"
    ids = ours.encode(prompt)
    assert ids == hf_tokenizer.encode(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    assert logits.shape == (len(ids), spec.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0.05  # random, but far from flat
    generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > len(ids)
    assert model.generation_config.eos_token_id == list(ours.eos_token_ids)


def test_default_model_vocabulary_is_the_tokenizers(tiny_checkpoints: dict[str, Path]) -> None:
    model_dir = tiny_checkpoints["tiny-llama"]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == Tokenizer.from_dir(model_dir).vocab_size == 1024
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["tie_word_embeddings"] is False


# ---------------------------------------------------------------- presets (metadata only)

# Parameter counts of the real models (their model cards and safetensors metadata).
REAL_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
}


@pytest.mark.parametrize("preset", sorted(REAL_PARAMETERS))
def test_presets_have_the_real_models_parameter_counts(preset: str) -> None:
    plan = mc.plan_checkpoint(mc.PRESETS[preset])
    assert plan.num_parameters == REAL_PARAMETERS[preset]
    assert plan.total_size == 2 * plan.num_parameters  # bfloat16


def test_preset_configs_have_the_real_shapes() -> None:
    llama8b = mc.model_config(mc.PRESETS["llama-3.1-8b"])
    assert (llama8b["hidden_size"], llama8b["intermediate_size"], llama8b["num_hidden_layers"]) == (4096, 14336, 32)
    assert (llama8b["num_attention_heads"], llama8b["num_key_value_heads"], llama8b["head_dim"]) == (32, 8, 128)
    assert llama8b["rope_scaling"] == {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert (llama8b["vocab_size"], llama8b["tie_word_embeddings"], llama8b["rope_theta"]) == (128256, False, 500000.0)
    llama1b = mc.model_config(mc.PRESETS["llama-3.2-1b"])
    assert llama1b["tie_word_embeddings"] is True and llama1b["rope_scaling"]["factor"] == 32.0
    assert (llama1b["hidden_size"], llama1b["num_hidden_layers"], llama1b["head_dim"]) == (2048, 16, 64)
    qwen06 = mc.model_config(mc.PRESETS["qwen3-0.6b"])
    assert (qwen06["model_type"], qwen06["head_dim"], qwen06["hidden_size"], qwen06["num_attention_heads"]) == (
        "qwen3", 128, 1024, 16)
    assert (qwen06["tie_word_embeddings"], qwen06["max_position_embeddings"], qwen06["rms_norm_eps"]) == (True, 40960, 1e-6)
    qwen8 = mc.model_config(mc.PRESETS["qwen3-8b"])
    assert (qwen8["num_hidden_layers"], qwen8["intermediate_size"], qwen8["tie_word_embeddings"]) == (36, 12288, False)
    qwen25 = mc.model_config(mc.PRESETS["qwen2.5-7b"])
    assert "head_dim" not in qwen25 and qwen25["use_sliding_window"] is False and qwen25["vocab_size"] == 152064


def test_big_model_plan_shards_by_size() -> None:
    plan = mc.plan_checkpoint(mc.PRESETS["llama-3.1-8b"])
    assert [s.filename for s in plan.shards] == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert all(s.nbytes <= mc.DEFAULT_MAX_SHARD_SIZE for s in plan.shards)
    names = [t.name for s in plan.shards for t in s.tensors]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight" and len(set(names)) == len(names)
    # A tensor larger than the limit gets a file of its own.
    tiny_limit = mc.plan_checkpoint(mc.PRESETS["llama-3.1-8b"], max_shard_size=10**6)
    assert all(len(s.tensors) == 1 or s.nbytes <= 10**6 for s in tiny_limit.shards)


def test_writing_a_big_tensor_keeps_memory_bounded(tmp_path: Path) -> None:
    """One 272 MB embedding is streamed in chunks: the peak grows by well under its size
    (88 MB seen in a fresh virtual environment, 260 MB if it were materialised whole)."""
    code = """
import sys, app.engine.make_checkpoint as mc, torch
def peak_mb():
    return int(dict(l.split(":", 1) for l in open("/proc/self/status"))["VmHWM"].split()[0]) / 1024
before = peak_mb()
spec = mc.PRESETS["qwen2.5-0.5b"].replace(num_layers=1)
mc.make_checkpoint(sys.argv[1], spec)
print(peak_mb() - before)
"""
    result = _run_python(code, str(tmp_path / "big"))
    assert result.returncode == 0, result.stderr
    embedding_mb = 151936 * 896 * 2 / 2**20
    assert float(result.stdout.split()[-1]) < embedding_mb / 2  # streamed: never the whole tensor at once
    assert (tmp_path / "big" / "model.safetensors").stat().st_size > 151936 * 896 * 2


# ---------------------------------------------------------------- validation and failure


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"architecture": "GPT2LMHeadModel"}, "architecture"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 130}, "head_dim"),
        ({"head_dim": 33}, "head_dim"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_scaling": mc.Llama3RopeScaling(factor=8.0, original_max_position_embeddings=10**6)}, "rope_scaling"),
    ],
)
def test_invalid_specs_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        mc.TINY_LLAMA.replace(**changes)


def test_qwen2_head_dim_must_match_hidden_size() -> None:
    with pytest.raises(ValueError, match="Qwen2"):
        mc.PRESETS["tiny-qwen2"].replace(head_dim=64)


def test_refuses_a_non_empty_directory_and_leaves_nothing_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        mc.make_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match="max_shard_size"):
        mc.make_checkpoint(tmp_path / "bad", max_shard_size=0)

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(mc, "_write_safetensors", fail)
    with pytest.raises(OSError, match="disk full"):
        mc.make_checkpoint(tmp_path / "broken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


# ---------------------------------------------------------------- the default model cache

_DEFAULT_DIR = "import app.engine.make_checkpoint as mc, sys; print(mc.default_model_dir()); print('torch' in sys.modules)"


def test_default_model_dir_builds_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path))
    model_dir = mc.default_model_dir()
    assert model_dir == tmp_path / "models" / mc.DEFAULT_MODEL_NAME
    assert mc.is_complete_checkpoint(model_dir, mc.TINY_LLAMA)
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert mc.default_model_dir() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp

    # Once built, resolving it is light: no torch import.
    result = _run_python(_DEFAULT_DIR, env={"APP_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(model_dir), "False"]


@pytest.mark.parametrize("damage", ["truncate", "delete", "no-manifest", "other-spec"])
def test_default_model_dir_rebuilds_an_incomplete_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path))
    model_dir = mc.default_model_dir()
    good = _hashes(model_dir)
    if damage == "truncate":
        with open(model_dir / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif damage == "delete":
        (model_dir / "tokenizer.json").unlink()
    elif damage == "no-manifest":
        (model_dir / mc.MANIFEST_FILE).unlink()
    else:
        manifest = json.loads((model_dir / mc.MANIFEST_FILE).read_text())
        manifest["spec"]["num_layers"] = 1
        (model_dir / mc.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert not mc.is_complete_checkpoint(model_dir, mc.TINY_LLAMA)
    assert mc.default_model_dir() == model_dir
    assert _hashes(model_dir) == good


def test_concurrent_first_use_builds_one_complete_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "APP_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _DEFAULT_DIR], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err for _, err in outputs]
    paths = {out.split()[0] for out, _ in outputs}
    model_dir = tmp_path / "models" / mc.DEFAULT_MODEL_NAME
    assert paths == {str(model_dir)}
    assert mc.is_complete_checkpoint(model_dir, mc.TINY_LLAMA)
    # No temporary directories left behind, and the result is the deterministic build.
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f".{mc.DEFAULT_MODEL_NAME}.lock", mc.DEFAULT_MODEL_NAME]
    assert _hashes(model_dir) == _hashes(mc.make_checkpoint(tmp_path / "reference"))


def test_losing_the_publish_race_without_a_lock_is_fine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where flock does nothing, a process whose rename loses uses the winner's checkpoint."""
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mc, "_exclusive_lock", lambda path: contextlib.nullcontext())
    real = mc.make_checkpoint

    def other_process_wins(out_dir: Path, spec: mc.ModelSpec) -> Path:
        real(out_dir, spec)  # the winner publishes first...
        return real(out_dir, spec)  # ...so our own publish finds the directory taken

    monkeypatch.setattr(mc, "make_checkpoint", other_process_wins)
    model_dir = mc.default_model_dir()
    assert mc.is_complete_checkpoint(model_dir, mc.TINY_LLAMA)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [mc.DEFAULT_MODEL_NAME]


# ---------------------------------------------------------------- the command line


def test_cli_help_lists_the_presets() -> None:
    result = subprocess.run([sys.executable, "tools/make_model.py", "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "tiny-llama"):
        assert name in result.stdout


def test_cli_applies_overrides_to_a_preset(tmp_path: Path) -> None:
    out = tmp_path / "m"
    args = ["tools/make_model.py", str(out), "--preset", "qwen3-0.6b", "--layers", "1", "--vocab-size", "2048",
            "--dtype", "float16", "--max-shard-size", "2MB", "--no-tie-word-embeddings"]
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["torch_dtype"]) == (1, 2048, "float16")
    assert (config["head_dim"], config["hidden_size"], config["tie_word_embeddings"]) == (128, 1024, False)
    assert (out / mc.INDEX_FILE).is_file()
    again = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert again.returncode == 2 and "not an empty directory" in again.stderr
    bad = subprocess.run([sys.executable, "tools/make_model.py", str(tmp_path / "x"), "--heads", "3"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "num_kv_heads" in bad.stderr
