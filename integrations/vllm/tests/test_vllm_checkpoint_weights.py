"""A universal checkpoint as vLLM's ``(name, tensor)`` weight stream: names, values, hashes (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.universal_ckpt import CheckpointIntegrityError, CheckpointLayoutError, save
from plait.universal_ckpt.mapped import MappedReader
from plait.universal_ckpt.reader import read_manifest
from plait.vllm.checkpoint_weights import CheckpointWeights
from plait.vllm.tensor_parallel import TensorParallelRank, rank_cols, rank_rows


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("scale", torch.arange(3.0))


def _saved(tmp_path):
    torch.manual_seed(0)
    model = _Block()
    save({"model": model}, tmp_path / "ckpt", step=3)
    return model


@pytest.mark.timeout(60)
def test_vllm_checkpoint_weights_stream_state_dict_names_and_values(tmp_path):
    model = _saved(tmp_path)
    weights = CheckpointWeights(tmp_path / "ckpt")  # a root: its latest step is used
    got = dict(weights)
    expected = model.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_vllm_checkpoint_weights_flipped_byte_names_the_file(tmp_path):
    _saved(tmp_path)
    step = tmp_path / "ckpt" / "step-0000000003"
    manifest = read_manifest(step)
    piece = next(iter(manifest.tensors.values())).pieces[0]
    data = step / piece.file
    raw = bytearray(data.read_bytes())
    raw[piece.offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointIntegrityError) as info:
        list(CheckpointWeights(step))
    assert piece.file in str(info.value) and "corrupt" in str(info.value)
    assert info.value.file == piece.file


@pytest.mark.timeout(60)
def test_vllm_checkpoint_weights_unknown_key_says_which_keys_exist(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointLayoutError, match="'model'"):
        CheckpointWeights(tmp_path / "ckpt", key="policy")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_vllm_checkpoint_weights_fused_experts_stream_as_hf_files_hold_them(tmp_path, family):
    """transformers keeps the experts of Mixtral and Qwen2-MoE fused in memory; the stream must carry
    what its save_pretrained writes (per-expert w1/w3/w2 under block_sparse_moe, per-expert
    gate/up/down_proj under mlp beside the shared expert), name for name, bit for bit."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "mixtral":
        model_cls, config = transformers.MixtralForCausalLM, transformers.MixtralConfig(num_local_experts=3, **common)
    else:
        model_cls = transformers.Qwen2MoeForCausalLM
        config = transformers.Qwen2MoeConfig(num_experts=3, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=40, **common)
    torch.manual_seed(0)
    model = model_cls(config)
    model.save_pretrained(tmp_path / "hf")
    save({"model": model}, tmp_path / "ckpt", step=0)
    on_disk = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    streamed = dict(CheckpointWeights(tmp_path / "ckpt", model_type=family))
    assert sorted(streamed) == sorted(on_disk)
    for name, tensor in on_disk.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=0, msg=name)


def test_vllm_checkpoint_weights_unknown_fused_family_is_refused():
    from plait.vllm.checkpoint_weights import on_disk_weights

    weights = torch.zeros(2, 4, 3)
    assert on_disk_weights("model.layers.0.mlp.experts.gate_up_proj", weights, None)[0][0].endswith("gate_up_proj")
    with pytest.raises(CheckpointLayoutError, match="model_type='qwen9_moe'"):
        on_disk_weights("model.layers.0.mlp.experts.gate_up_proj", weights, "qwen9_moe")


def test_vllm_rank_rows_follow_vllms_dim0_splits():
    tp2 = [TensorParallelRank(rank=r, size=2, num_key_value_heads=2) for r in range(2)]
    assert [rank_rows("model.layers.0.self_attn.q_proj.weight", (32, 16), t) for t in tp2] == [(0, 16), (16, 32)]
    assert rank_rows("model.layers.0.mlp.up_proj.weight", (48, 16), tp2[1]) == (24, 48)
    assert rank_rows("model.layers.0.self_attn.k_proj.weight", (16, 16), tp2[1]) == (8, 16)
    # 2 KV heads on 4 ranks: each head is kept by two ranks.
    tp4 = [TensorParallelRank(rank=r, size=4, num_key_value_heads=2) for r in range(4)]
    assert [rank_rows("model.layers.0.self_attn.v_proj.weight", (16, 16), t) for t in tp4] == [
        (0, 8), (0, 8), (8, 16), (8, 16)]
    # The vocabulary is padded to 64 and split evenly; the last block is clipped (or empty).
    assert [rank_rows("lm_head.weight", (100, 16), t) for t in tp2] == [(0, 64), (64, 100)]
    assert [rank_rows("model.embed_tokens.weight", (100, 16), t) for t in tp4] == [(0, 32), (32, 64), (64, 96),
                                                                                  (96, 100)]
    # Not split along dim 0, TP=1, no KV heads known, sizes that do not divide: whole.
    assert rank_rows("model.layers.0.self_attn.o_proj.weight", (16, 32), tp2[0]) is None
    assert rank_rows("model.layers.0.mlp.down_proj.weight", (16, 48), tp2[0]) is None
    assert rank_rows("model.norm.weight", (16,), tp2[0]) is None
    assert rank_rows("model.layers.0.self_attn.q_proj.weight", (32, 16), TensorParallelRank(rank=0, size=1)) is None
    assert rank_rows("model.layers.0.self_attn.k_proj.weight", (16, 16), TensorParallelRank(rank=0, size=2)) is None
    assert rank_rows("model.layers.0.mlp.gate_proj.weight", (45, 16), tp2[0]) is None
    with pytest.raises(ValueError, match="rank"):
        TensorParallelRank(rank=2, size=2)


def test_vllm_rank_cols_follow_vllms_row_parallel_splits():
    tp2 = [TensorParallelRank(rank=r, size=2) for r in range(2)]
    assert [rank_cols("model.layers.0.self_attn.o_proj.weight", (16, 32), t) for t in tp2] == [(0, 16), (16, 32)]
    assert rank_cols("model.layers.0.mlp.down_proj.weight", (16, 48), tp2[1]) == (24, 48)
    # Not row-parallel, TP=1, columns that do not divide: none.
    assert rank_cols("model.layers.0.self_attn.q_proj.weight", (32, 16), tp2[0]) is None
    assert rank_cols("model.layers.0.self_attn.o_proj.weight", (16, 32), TensorParallelRank(rank=0, size=1)) is None
    assert rank_cols("model.layers.0.mlp.down_proj.weight", (16, 45), tp2[0]) is None


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def save_split(root: str, world: int) -> None:
    """One rank of a ToyZero stage-3 save: tensors straddling a rank boundary are split in two pieces."""
    from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig

    save({"model": ToyZero(_tiny_llama(), ToyZeroConfig(stage=3))}, root, step=0, chunk_bytes=4096)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("producer", ["one-process", "zero-w2"])
def test_vllm_simulated_rank_reads_and_checks_only_its_rows(tmp_path, monkeypatch, producer):
    from plait.kernels.testing import run_distributed
    from plait.universal_ckpt import mapped, reader

    model = _tiny_llama()
    expected = model.state_dict()
    root = tmp_path / "ckpt"
    if producer == "one-process":
        save({"model": model}, root, step=0, chunk_bytes=4096)  # small chunks: rows fall in different chunks
    else:
        run_distributed(save_split, 2, str(root), 2, timeout=120)
    checked = []  # bytes checked (whole pieces: mapped) and read (split pieces)
    original_check, original_read = mapped.check_chunks, reader.read_verified
    monkeypatch.setattr(mapped, "check_chunks", lambda view, *a, **k: checked.append(len(view)) or
                        original_check(view, *a, **k))
    monkeypatch.setattr(reader, "read_verified", lambda *a, start, stop, **k: checked.append(stop - start) or
                        original_read(*a, start=start, stop=stop, **k))
    whole = sum(t.numel() * t.element_size() for t in expected.values())
    split_names = set()
    for size in (1, 2, 4):
        for rank in range(size):
            checked.clear()
            tp = TensorParallelRank(rank=rank, size=size, num_key_value_heads=2)
            weights = CheckpointWeights(root, key="model", tensor_parallel=tp)
            streamed = dict(weights)
            assert sorted(streamed) == sorted(expected)
            for name, tensor in expected.items():
                rows = weights.rows_read.get(name)
                got = streamed[name] if rows is None else streamed[name][rows[0]:rows[1]]
                want = tensor if rows is None else tensor[rows[0]:rows[1]]
                assert streamed[name].shape == tensor.shape and torch.equal(got, want), (size, rank, name)
                if rows is not None and len(weights.manifest.tensors[f"model/{name}"].pieces) > 1:
                    split_names.add(name)
            if size == 1:
                assert not weights.rows_read and sum(checked) >= whole
                continue
            assert {n.rsplit(".", 2)[-2] for n in weights.rows_read} == {
                "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"}
            assert sum(checked) < whole  # the rank touched less than the whole checkpoint
    if producer == "zero-w2":
        assert split_names, "the W=2 save should have split at least one dim-0 tensor over two pieces"


def _copy_all(weights: CheckpointWeights, dest: dict[str, torch.Tensor]) -> None:
    """What the loader does: vLLM's weight loaders copy every streamed tensor into a parameter."""
    with weights.checked_on_copy() as stream:
        for name, tensor in stream:
            dest[name].copy_(tensor)


@pytest.mark.timeout(60)
def test_vllm_checked_on_copy_copies_every_value_and_checks_every_byte_once(tmp_path):
    model = _saved(tmp_path)
    expected = model.state_dict()
    dest = {name: torch.zeros_like(t) for name, t in expected.items()}
    weights = CheckpointWeights(tmp_path / "ckpt")
    _copy_all(weights, dest)
    for name, tensor in expected.items():
        torch.testing.assert_close(dest[name], tensor, rtol=0, atol=0)
    pieces = [p for e in weights.entries() for p in e.pieces]
    assert weights.checked_bytes == sum(p.nbytes for p in pieces)


def _flip(step, tensor_name: str) -> str:
    piece = read_manifest(step).tensors[tensor_name].pieces[0]
    raw = bytearray((step / piece.file).read_bytes())
    raw[piece.offset + 1] ^= 0x01
    (step / piece.file).write_bytes(bytes(raw))
    return piece.file


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use", ["copy", "clone", "in_place", "untouched"])
def test_vllm_checked_on_copy_flipped_byte_fails_naming_the_file(tmp_path, use):
    """However the consumer uses a damaged tensor (copies it, reads it otherwise, writes to it, or
    never touches it), the load fails naming the file; no damaged value reaches the caller."""
    _saved(tmp_path)
    step = tmp_path / "ckpt" / "step-0000000003"
    damaged = _flip(step, "model/proj.weight")
    weights = CheckpointWeights(step)
    seen = {}
    with pytest.raises(CheckpointIntegrityError) as info, weights.checked_on_copy() as stream:
        for name, tensor in stream:
            if name != "proj.weight":
                continue
            if use == "copy":
                seen["copy"] = torch.zeros_like(tensor)  # the damaged chunk is zeroed in it before copy_ raises
                seen["copy"].copy_(tensor)
            elif use == "clone":
                seen[name] = tensor.clone()
            elif use == "in_place":
                tensor.mul_(2)
    assert info.value.file == damaged and damaged in str(info.value) and "model/proj.weight" in str(info.value)
    copied = seen.pop("copy", None)
    assert not seen and (copied is None or not copied.any())


class _RowParallel(nn.Module):
    """Two row-parallel weights whose rows are wider than a 4 KiB checksum chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.o_proj = nn.Linear(2048, 8, bias=False)  # 8 KiB rows: 2 chunks
        self.mlp = nn.Module()
        self.mlp.down_proj = nn.Linear(4096, 6, bias=False)  # 16 KiB rows: 4 chunks


def _row_parallel_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"layers": nn.ModuleList([_RowParallel()])})


def save_row_parallel_split(root: str, world: int) -> None:
    """One rank of a ToyZero stage-3 save of :func:`_row_parallel_model`: down_proj straddles the
    rank boundary, so it is stored in two pieces."""
    from plait.universal_ckpt.testing import ToyZero, ToyZeroConfig

    save({"model": ToyZero(_row_parallel_model(), ToyZeroConfig(stage=3))}, root, step=0, chunk_bytes=4096)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("producer", ["one-process", "zero-w2"])
def test_vllm_tp_rank_reads_and_checks_only_its_columns_of_row_parallel_weights(tmp_path, monkeypatch, producer):
    """Row-parallel weights narrowed along dim 1 (vLLM's RowParallelLinear), saved with chunks
    shorter than a row's part: each rank of TP=2 reads and checks only the chunks of its columns
    (half the bytes), whether the weight is one mapped piece or consolidated from a ZeRO save's
    two pieces, and gets the right values. In one piece, a flipped byte in the other rank's columns
    is not read (that rank's own load finds it), while one in its own columns fails naming the file."""
    from plait.kernels.testing import run_distributed
    from plait.universal_ckpt import reader

    expected = _row_parallel_model().state_dict()
    if producer == "one-process":
        save({"model": _row_parallel_model()}, tmp_path / "ckpt", step=0, chunk_bytes=4096)
    else:
        run_distributed(save_row_parallel_split, 2, str(tmp_path / "ckpt"), 2, timeout=120)
    step = tmp_path / "ckpt" / "step-0000000000"
    read = []  # bytes read from split pieces
    original_read = reader.read_verified
    monkeypatch.setattr(reader, "read_verified", lambda *a, start, stop, **k: read.append(stop - start) or
                        original_read(*a, start=start, stop=stop, **k))

    def load(rank: int) -> tuple[CheckpointWeights, int]:
        tp = TensorParallelRank(rank=rank, size=2)
        weights = CheckpointWeights(step, key="model", tensor_parallel=tp)
        read.clear()
        with weights.checked_on_copy() as stream:
            for name, tensor in stream:
                assert torch.equal(_vllm_like_copy(name, tensor, tp), _vllm_like_copy(name, expected[name], tp))
        return weights, (weights.checked_bytes or 0) + sum(read)

    whole = sum(t.numel() * t.element_size() for t in expected.values())
    for rank in range(2):
        weights, touched = load(rank)
        assert touched == whole // 2, (rank, touched, whole)
        if producer == "zero-w2":
            assert weights.cols_read == {"layers.0.mlp.down_proj.weight": (2048 * rank, 2048 * (rank + 1))}
    if producer == "zero-w2":
        return
    piece = read_manifest(step).tensors["model/layers.0.self_attn.o_proj.weight"].pieces[0]
    raw = bytearray((step / piece.file).read_bytes())
    raw[piece.offset + 2048 * 4 + 1024 * 4 + 8] ^= 0x01  # row 1, column 1026: rank 1's half
    (step / piece.file).write_bytes(bytes(raw))
    assert load(0)[1] == whole // 2
    with pytest.raises(CheckpointIntegrityError) as info:
        load(1)
    assert info.value.file == piece.file and "o_proj" in str(info.value)


def _tiny_llama_saved(root, producer: str):
    if producer == "one-process":
        save({"model": _tiny_llama()}, root, step=0, chunk_bytes=4096)  # small chunks: rows fall in different chunks
    else:
        from plait.kernels.testing import run_distributed

        run_distributed(save_split, 2, str(root), 2, timeout=120)


def _vllm_like_copy(name: str, tensor: torch.Tensor, tp: TensorParallelRank) -> torch.Tensor:
    """A rank's part as vLLM's weight loaders take it: dim-0 rows by plait.vllm.tensor_parallel's rules,
    row-parallel o_proj/down_proj narrowed along dim 1, everything else whole; copied into a new tensor."""
    rows = rank_rows(name, tuple(tensor.shape), tp)
    if rows is not None:
        part = tensor.narrow(0, rows[0], rows[1] - rows[0])
    elif name.endswith(("o_proj.weight", "down_proj.weight")) and tensor.shape[1] % tp.size == 0:
        cols = tensor.shape[1] // tp.size
        part = tensor.narrow(1, tp.rank * cols, cols)
    else:
        part = tensor
    return torch.empty(part.shape, dtype=part.dtype).copy_(part)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("producer", ["one-process", "zero-w2"])
def test_vllm_tp_rank_reads_and_checks_only_the_byte_ranges_it_copies(tmp_path, producer):
    """At TP 1, 2 and 4, each simulated rank copies its part as vLLM does, under the loader's
    checked_on_copy: every part equals the slice of the full tensor, and the bytes the rank checked
    (for a mapped tensor, the only bytes it reads) are exactly the chunks its dim-0 rows span plus
    whole tensors elsewhere; at TP > 1 less than the checkpoint, at TP 1 all of it."""
    root = tmp_path / "ckpt"
    expected = _tiny_llama().state_dict()
    _tiny_llama_saved(root, producer)
    whole = sum(t.numel() * t.element_size() for t in expected.values())
    for size in (1, 2, 4):
        for rank in range(size):
            tp = TensorParallelRank(rank=rank, size=size, num_key_value_heads=2)
            weights = CheckpointWeights(root, key="model", tensor_parallel=tp)
            want_checked = 0
            with weights.checked_on_copy() as stream:
                for name, tensor in stream:
                    got = _vllm_like_copy(name, tensor, tp)
                    assert torch.equal(got, _vllm_like_copy(name, expected[name], tp)), (size, rank, name)
                    entry = weights.manifest.tensors[f"model/{name}"]
                    if MappedReader.whole_piece(entry) is None:
                        continue  # consolidated: checked as it is read, not by the mode
                    rows = rank_rows(name, entry.global_shape, tp)
                    row = entry.nbytes // entry.global_shape[0]
                    start, stop = (0, entry.nbytes) if rows is None else (rows[0] * row, rows[1] * row)
                    chunk = weights.manifest.chunk_bytes
                    want_checked += (min(entry.nbytes, -(-stop // chunk) * chunk) - start // chunk * chunk
                                     if stop > start else 0)
            assert weights.checked_bytes == want_checked, (size, rank)
            if producer == "one-process":
                assert (weights.checked_bytes == whole) if size == 1 else (weights.checked_bytes < whole), (size, rank)
