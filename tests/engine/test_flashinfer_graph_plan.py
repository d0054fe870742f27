"""The host-side parts of the flashinfer backend's decode CUDA graphs, on the CPU: the padded
page table (host indptr, indices gathered on the device), and the graph protocol driven over a
stand-in for flashinfer that keeps the rules of flashinfer 0.7.2's decode wrapper in
``use_cuda_graph`` mode (flashinfer/decode.py, BatchDecodeWithPagedKVCacheWrapper): the batch
size is fixed by the buffers given at construction, plan() copies into those buffers, run()
reads only them and takes q of exactly that batch size. The real kernels are checked against
eager runs in test_flashinfer_graph_gpu.py."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from app.engine.cuda_graph import (
    DUMMY_SLOT,
    INPUT_IDS,
    REQ_POOL_INDICES,
    SEQ_LENS,
    StaticDecodeInputs,
    graph_batch_size,
)
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool
from app.engine.attention.flashinfer_backend import gather_page_indices, padded_decode_indptr
from app.engine.attention.torch_backend import TorchAttentionBackend


def test_padded_indptr_gives_each_padded_row_one_page():
    assert padded_decode_indptr([31, 13, 82], 4) == [0, 31, 44, 126, 127]
    assert padded_decode_indptr([5], 1) == [0, 5]
    assert padded_decode_indptr([], 4) == [0, 1, 2, 3, 4]  # capture: every row padding
    with pytest.raises(ValueError):
        padded_decode_indptr([1, 2, 3], 2)
    with pytest.raises(ValueError):
        padded_decode_indptr([4, 0], 2)  # a real decode row has its new token at least


def test_gathered_indices_are_each_rows_slots_then_the_dummy_slot():
    table = ReqToTokenPool(4, 16)
    table.req_to_token[2, :5] = torch.tensor([7, 8, 3, 4, 11], dtype=torch.int32)
    table.req_to_token[0, :3] = torch.tensor([9, 12, 13], dtype=torch.int32)  # a live row 0
    out = torch.full((20,), -1, dtype=torch.int32)
    gather_page_indices(out, table.req_to_token, torch.tensor([2, 0]), torch.tensor([5, 2]), total=7, num_padded=3)
    assert out[:10].tolist() == [7, 8, 3, 4, 11, 9, 12, DUMMY_SLOT, DUMMY_SLOT, DUMMY_SLOT]
    assert (out[10:] == -1).all()  # nothing past the step's pages
    gather_page_indices(out, table.req_to_token, torch.tensor([], dtype=torch.int64),
                        torch.tensor([], dtype=torch.int64), total=0, num_padded=2)
    assert out[:3].tolist() == [DUMMY_SLOT, DUMMY_SLOT, 3]


# ---------------------------------------------------------------------- a stand-in for flashinfer


def _paged_attention(q, k_pages, v_pages, indptr, indices, last_page_len, scale):
    """Each row i attends the pages ``indices[indptr[i]:indptr[i + 1]]`` (one token each), float32."""
    assert (last_page_len == 1).all() and k_pages.shape[1] == 1  # pages of one token, all full
    group = q.shape[1] // k_pages.shape[2]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
        keys = k_pages[pages, 0].float().repeat_interleave(group, 1)  # [S, H, D]
        values = v_pages[pages, 0].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,shd->hs", q[i].float(), keys) * (scale or q.shape[-1] ** -0.5)
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), values).to(q.dtype)
    return out


class FakeDecodeWrapper:
    """BatchDecodeWithPagedKVCacheWrapper as this backend uses it, with flashinfer 0.7.2's checks."""

    instances: list[FakeDecodeWrapper] = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            assert all(torch.is_tensor(t) and t.dtype == torch.int32 for t in buffers)
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self.fixed_batch_size + 1
        self.indptr, self.indices, self.last_page_len = paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer
        self.plans = 0
        FakeDecodeWrapper.instances.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type, kv_data_type, sm_scale=None):
        assert page_size == 1 and num_qo_heads % num_kv_heads == 0 and q_data_type == kv_data_type
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        # Our design keeps these two on the host: plan() reads them there (indptr.to("cpu")).
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"
        batch_size = len(last_page_len)
        assert len(indptr) == batch_size + 1 and int(indptr[-1]) == len(indices)
        assert (indptr[1:] - indptr[:-1] >= 1).all(), "every row needs a page (padded rows: the dummy slot)"
        if self.graph:
            assert batch_size == self.fixed_batch_size, "one wrapper per captured batch size"
            assert len(indices) <= len(self.indices)
            self.indptr.copy_(indptr)
            self.last_page_len.copy_(last_page_len)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last_page_len = indptr.clone(), indices.clone(), last_page_len.clone()
        self.scale = sm_scale
        self.plans += 1

    def run(self, q, paged_kv_cache):
        assert q.shape[0] == len(self.last_page_len), "q must have the planned batch size"
        k_pages, v_pages = paged_kv_cache
        return _paged_attention(q, k_pages, v_pages, self.indptr, self.indices, self.last_page_len, self.scale)


class FakePrefillWrapper:
    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "NHD"


@pytest.fixture
def fake_flashinfer(monkeypatch):
    FakeDecodeWrapper.instances = []
    module = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecodeWrapper,
                                   BatchPrefillWithPagedKVCacheWrapper=FakePrefillWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
MAX_BS, CONTEXT = 8, 48


def _setup(seed: int):
    from app.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(num_slots=400, num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    pool.k[0][DUMMY_SLOT] = 0  # as a fresh pool: the dummy slot holds only padding's K/V
    pool.v[0][DUMMY_SLOT] = 0
    table = ReqToTokenPool(MAX_BS, CONTEXT)
    backend = FlashInferAttentionBackend(pool, table, num_heads=HEADS)
    return gen, pool, table, backend


def test_graph_steps_over_the_stand_in_equal_eager_ones_through_padded_sizes(fake_flashinfer):
    gen, pool, table, backend = _setup(3)
    rng = random.Random(3)
    sizes = (1, 2, 4, 8)
    inputs = StaticDecodeInputs(MAX_BS, torch.device("cpu"))
    backend.init_cuda_graph_state(MAX_BS)
    assert backend._graph_indices.numel() == MAX_BS * CONTEXT  # the bound that holds with shared prefixes
    metas = {bs: backend.init_forward_metadata_capture(bs, inputs.view(REQ_POOL_INDICES, bs), inputs.view(SEQ_LENS, bs))
             for bs in sizes}
    graph_wrappers = FakeDecodeWrapper.instances[1:]  # [0] is the eager one
    assert [w.fixed_batch_size for w in graph_wrappers] == list(sizes)
    assert all(w.use_tensor_cores for w in FakeDecodeWrapper.instances)  # group 4: as eager
    assert all(w.indices is backend._graph_indices for w in graph_wrappers)  # one shared indices buffer
    torch_backend = TorchAttentionBackend(pool, table)

    # Row 0 holds a live request, so a padded row (request-table row 0) must not read it.
    lens = {row: rng.randrange(1, CONTEXT - 6) for row in range(MAX_BS)}
    free = iter(rng.sample(range(1, pool.num_slots), pool.num_slots - 1))
    for row, n in lens.items():
        table.req_to_token[row, :n] = torch.tensor([next(free) for _ in range(n)], dtype=torch.int32)
    shared = table.req_to_token[1, : lens[1]].clone()
    table.req_to_token[2, : lens[1]] = shared  # rows 1 and 2 share a prefix (as the radix cache does)
    lens[2] = max(lens[2], lens[1])

    # A large step first, so that smaller ones replay over stale rows; 3 -> 4, 5 -> 8, 1, 2 exact.
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7], [4, 0, 7], [2, 1, 5, 6, 3], [6], [7, 1]):
        b = len(rows)
        bs = graph_batch_size(sizes, b)
        prefix_lens = [lens[r] for r in rows]
        slots = torch.tensor([next(free) for _ in rows])
        inputs.fill(bs, [1] * b, rows, prefix_lens, slots, table)
        backend.init_forward_metadata_replay(bs, inputs.view(REQ_POOL_INDICES, bs), inputs.view(SEQ_LENS, bs),
                                             [p + 1 for p in prefix_lens])
        total = sum(prefix_lens) + b
        assert backend._graph_indptr[: bs + 1].tolist() == padded_decode_indptr([p + 1 for p in prefix_lens], bs)
        assert backend._graph_indices[total : total + bs - b].tolist() == [DUMMY_SLOT] * (bs - b)
        q = torch.randn((bs, HEADS, HEAD_DIM), generator=gen, dtype=torch.bfloat16)
        k = torch.randn((bs, KV_HEADS, HEAD_DIM), generator=gen, dtype=torch.bfloat16)
        v = torch.randn((bs, KV_HEADS, HEAD_DIM), generator=gen, dtype=torch.bfloat16)
        before = pool.k[0].clone()
        graphed = backend.forward(q, k, v, 0, inputs.batch(bs, backend, metas[bs]))
        assert graphed.shape == (bs, HEADS, HEAD_DIM)
        written = (pool.k[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(written) <= {*slots.tolist(), DUMMY_SLOT}  # padded rows write the dummy slot only

        eager_batch = ForwardBatch.build(mode=ForwardMode.DECODE, req_pool_indices=rows, prefix_lens=prefix_lens,
                                         extend_lens=[1] * b, out_cache_loc=slots, req_to_token_pool=table,
                                         attn_backend=backend)
        eager = backend.forward(q[:b], k[:b], v[:b], 0, eager_batch)
        assert torch.equal(graphed[:b], eager), rows  # same pages, same kernel: the same numbers
        reference_batch = ForwardBatch.build(mode=ForwardMode.DECODE, req_pool_indices=rows, prefix_lens=prefix_lens,
                                             extend_lens=[1] * b, out_cache_loc=slots, req_to_token_pool=table,
                                             attn_backend=torch_backend)
        reference = torch_backend.forward(q[:b], k[:b], v[:b], 0, reference_batch)
        torch.testing.assert_close(graphed[:b].float(), reference.float(), atol=2e-2, rtol=2e-2)
        for r, p in zip(rows, prefix_lens):
            lens[r] = p + 1
    assert [w.plans for w in graph_wrappers] == [1 + 1, 1 + 1, 1 + 1, 1 + 2]  # capture, then each replay


class _RecordingBackend:
    """A DecodeGraphBackend that records what the graph runner passes it."""

    def __init__(self):
        self.replays = []

    def init_forward_metadata(self, batch):
        return None

    def init_cuda_graph_state(self, max_bs):
        self.max_bs = max_bs

    def init_forward_metadata_capture(self, bs, req_pool_indices, seq_lens):
        return None

    def init_forward_metadata_replay(self, bs, req_pool_indices, seq_lens, seq_lens_cpu):
        self.replays.append((bs, req_pool_indices.tolist(), seq_lens.tolist(), list(seq_lens_cpu)))


class _ZeroModel(torch.nn.Module):
    config = types.SimpleNamespace(vocab_size=16)
    dtype = torch.float32

    def forward(self, input_ids, positions, batch, float_logits=True, argmax_keys=None, logits_out=None):
        if logits_out is not None:  # a graph's static buffer, written in place as the model does
            return logits_out.zero_()
        return torch.zeros((input_ids.shape[0], 16))


def test_the_runner_passes_the_real_rows_host_lengths_to_the_backend():
    from test_cuda_graph_plan import EagerReplayRunner

    backend, table = _RecordingBackend(), ReqToTokenPool(8, 64)
    runner = EagerReplayRunner(_ZeroModel(), backend, table, (1, 2, 4), capture_stream=None)
    logits = runner.replay([4, 0, 7], [30, 12, 5], [1, 2, 3], torch.tensor([903, 17, 412]))
    assert logits.shape == (3, 16)
    assert backend.replays == [(4, [4, 0, 7, 0], [31, 13, 6, 0], [31, 13, 6])]
    assert runner.inputs.view(INPUT_IDS, 4).tolist() == [1, 2, 3, 0]
