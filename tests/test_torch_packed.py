"""Exactness of packed training through packprep.training (CPU, float32, tiny random Llama).

For every packed sequence of a few packed rows, the logits and the per-sequence loss of the
packed forward pass equal those of the sequence run alone; broken batches (position ids not
restarted, an all-ones attention mask) are shown to break that; check_isolation catches the
use_cache=True default.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from packprep.layout import ROW_SCHEMA  # noqa: E402

from packprep.training import (  # noqa: E402
    IGNORE_INDEX,
    PackedDataset,
    PackingIsolationError,
    check_isolation,
    collate_packed,
    collate_padded,
    num_supervised_tokens,
    register_varlen_attention,
)

VOCAB = 128
torch.set_num_threads(min(2, torch.get_num_threads()))  # tiny matmuls: more threads only contend
ATOL = 1e-4
MAX_LEN = 96


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make_rows(seed: int = 0, n_rows: int = 3, max_len: int = MAX_LEN) -> list[dict]:
    """Packed rows following the shard contract (first label of each sequence is -100)."""
    rng = np.random.default_rng(seed)
    rows, src = [], 0
    for _ in range(n_rows):
        lens = []
        while True:
            n = int(rng.integers(5, 40))
            if sum(lens) + n > max_len:
                break
            lens.append(n)
        ids, labels, pos = [], [], []
        for n in lens:
            seq = rng.integers(3, VOCAB, n)
            prompt = int(rng.integers(1, n))  # tokens before the response are not trained
            lab = seq.copy()
            lab[:prompt] = IGNORE_INDEX
            lab[0] = IGNORE_INDEX
            ids.append(seq)
            labels.append(lab)
            pos.append(np.arange(n))
        rows.append(
            {
                "input_ids": np.concatenate(ids).astype(np.int32),
                "labels": np.concatenate(labels).astype(np.int32),
                "position_ids": np.concatenate(pos).astype(np.int32),
                "seq_lens": np.array(lens, dtype=np.int32),
                "source_index": np.arange(src, src + len(lens), dtype=np.int64),
            }
        )
        src += len(lens)
    return rows


def write_shards(out_dir, rows, fmt: str = "parquet", n_shards: int = 2) -> None:
    """A packprep output folder written with pyarrow directly (stand-in for the real writer)."""
    data = out_dir / "data"
    data.mkdir(parents=True)
    schema = ROW_SCHEMA
    parts = np.array_split(np.arange(len(rows)), n_shards)
    for k, idx in enumerate(parts):
        cols = {name: [rows[i][name].tolist() for i in idx] for name in schema.names}
        table = pa.table(cols, schema=schema)
        path = data / f"train-{k:05d}-of-{n_shards:05d}.{fmt}"
        if fmt == "parquet":
            pq.write_table(table, path)
        else:
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                writer.write_table(table)
    manifest = {"config": {"max_len": MAX_LEN, "strategy": "ffd"}}
    (out_dir / "packprep.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_cache=False,
    )
    m = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("packed")
    write_shards(out, make_rows())
    return PackedDataset(out)


def forward_logits(model, batch: dict) -> torch.Tensor:
    call = {k: v for k, v in batch.items() if k not in ("labels", "num_supervised_tokens")}
    with torch.no_grad():
        return model(**call).logits.float()


def seq_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed causal-LM cross entropy of ONE sequence (logits (n, V), labels (n,))."""
    return torch.nn.functional.cross_entropy(
        logits[:-1], labels[1:].long(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


_ALONE_CACHE: dict = {}


def alone(model, seq_ids: np.ndarray) -> torch.Tensor:
    """Logits of one sequence run by itself (cached: the model's weights never change here)."""
    key = (id(model), model.config._attn_implementation, np.asarray(seq_ids).tobytes())
    if key not in _ALONE_CACHE:
        ids = torch.as_tensor(seq_ids, dtype=torch.long)[None]
        with torch.no_grad():
            _ALONE_CACHE[key] = model(input_ids=ids, use_cache=False).logits[0].float()
    return _ALONE_CACHE[key]


# ---------------------------------------------------------------------------------------------
# dataset + collators
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_dataset_reads_rows(tmp_path, fmt):
    rows = make_rows(seed=1, n_rows=5)
    write_shards(tmp_path, rows, fmt=fmt)
    ds = PackedDataset(tmp_path)
    assert len(ds) == 5
    assert ds.max_len == MAX_LEN
    for i, row in enumerate(rows):
        got = ds[i]
        for name in row:
            np.testing.assert_array_equal(got[name], row[name])
    np.testing.assert_array_equal(ds[-1]["input_ids"], rows[-1]["input_ids"])
    with pytest.raises(IndexError):
        ds[5]
    # a plain list of files works too
    ds2 = PackedDataset(sorted((tmp_path / "data").iterdir()))
    assert len(ds2) == 5


def test_collate_packed_contract(dataset):
    rows = [dataset[0], dataset[1]]
    batch = collate_packed(rows, count=True)
    assert "attention_mask" not in batch
    assert batch["use_cache"] is False
    t = sum(len(r["input_ids"]) for r in rows)
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].shape == (1, t) and batch[key].dtype == torch.long
    seq_lens = np.concatenate([r["seq_lens"] for r in rows])
    cu = np.concatenate([[0], np.cumsum(seq_lens)])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert batch[key].dtype == torch.int32
        np.testing.assert_array_equal(batch[key].numpy(), cu)
    assert batch["max_length_q"] == batch["max_length_k"] == int(seq_lens.max())
    assert isinstance(batch["max_length_q"], int)
    expected_pos = np.concatenate([np.arange(n) for n in seq_lens])
    np.testing.assert_array_equal(batch["position_ids"][0].numpy(), expected_pos)
    # num_supervised_tokens counts labels[1:] != -100 of each sequence (after the shift)
    labels = np.concatenate([r["labels"] for r in rows])
    expected = sum(
        int((labels[a + 1 : b] != IGNORE_INDEX).sum()) for a, b in zip(cu[:-1], cu[1:])
    )
    assert batch["num_supervised_tokens"] == expected
    assert expected == int((batch["labels"][0, 1:] != IGNORE_INDEX).sum())


def test_num_supervised_tokens_ignores_first_label():
    # a (contract-violating) trained first label is not counted and is masked by the collator
    row = {"input_ids": np.arange(6), "labels": np.arange(6), "seq_lens": np.array([3, 3])}
    assert num_supervised_tokens(row["labels"], row["seq_lens"]) == 4
    batch = collate_packed([row], count=True)
    assert batch["labels"][0, 0] == IGNORE_INDEX and batch["labels"][0, 3] == IGNORE_INDEX
    assert batch["num_supervised_tokens"] == 4


def test_collate_packed_rejects_unrestarted_positions(dataset):
    row = dict(dataset[0])
    row["position_ids"] = np.arange(len(row["input_ids"]), dtype=np.int32)
    with pytest.raises(ValueError, match="restart"):
        collate_packed([row])


def test_collate_padded(dataset):
    rows = [dataset[0], dataset[1]]
    batch = collate_padded(rows, pad_token_id=0, count=True)
    seq_lens = np.concatenate([r["seq_lens"] for r in rows])
    assert batch["input_ids"].shape == (len(seq_lens), int(seq_lens.max()))
    np.testing.assert_array_equal(batch["attention_mask"].sum(1).numpy(), seq_lens)
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert batch["num_supervised_tokens"] == collate_packed(rows, count=True)["num_supervised_tokens"]


# ---------------------------------------------------------------------------------------------
# exactness
# ---------------------------------------------------------------------------------------------


def test_packed_equals_unpacked(model, dataset):
    total_packed = torch.zeros((), dtype=torch.float64)
    total_alone = torch.zeros((), dtype=torch.float64)
    n_sup = 0
    # every row alone, and all rows concatenated into one (1, T) batch
    batches = [[dataset[i]] for i in range(len(dataset))] + [[dataset[i] for i in range(len(dataset))]]
    for rows in batches:
        batch = collate_packed(rows, count=True)
        logits = forward_logits(model, batch)[0]
        labels = batch["labels"][0]
        cu = batch["cu_seq_lens_q"].tolist()
        ids = batch["input_ids"][0].numpy()
        for a, b in zip(cu[:-1], cu[1:]):
            ref = alone(model, ids[a:b])
            torch.testing.assert_close(logits[a:b], ref, atol=ATOL, rtol=0)
            lp, la = seq_loss_sum(logits[a:b], labels[a:b]), seq_loss_sum(ref, labels[a:b])
            torch.testing.assert_close(lp, la, atol=ATOL, rtol=1e-5)
            if len(rows) > 1:
                total_packed += lp.double()
                total_alone += la.double()
        if len(rows) > 1:
            n_sup = batch["num_supervised_tokens"]
            # the model's own (shifted, flat) loss over the packed batch equals the unpacked one:
            # sequence starts carry label -100, so no token is predicted across a boundary
            call = {k: v for k, v in batch.items() if k != "num_supervised_tokens"}
            with torch.no_grad():
                hf_loss = model(**call, num_items_in_batch=n_sup).loss
            torch.testing.assert_close(hf_loss.double(), total_alone / n_sup, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(total_packed, total_alone, atol=ATOL * 10, rtol=1e-6)
    assert n_sup > 0


def _max_diff_vs_alone(model, batch) -> float:
    logits = forward_logits(model, batch)[0]
    cu = batch["cu_seq_lens_q"].tolist()
    ids = batch["input_ids"][0].numpy()
    return max(float((logits[a:b] - alone(model, ids[a:b])).abs().max()) for a, b in zip(cu[:-1], cu[1:]))


def test_broken_batches_are_detected(model, dataset):
    batch = collate_packed([dataset[0], dataset[1]])
    assert _max_diff_vs_alone(model, batch) < ATOL
    # 1. position ids not restarted: one long sequence, cross contamination
    broken = dict(batch)
    broken["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    assert _max_diff_vs_alone(model, broken) > 1e-2
    # 2. restarted position ids but an all-ones attention mask: packed detection is skipped
    broken = dict(batch)
    broken["attention_mask"] = torch.ones_like(batch["input_ids"])
    assert _max_diff_vs_alone(model, broken) > 1e-2


def test_padded_batch_equals_unpacked(model, dataset):
    batch = collate_padded([dataset[0]])
    call = {k: v for k, v in batch.items() if k not in ("labels", "num_supervised_tokens")}
    with torch.no_grad():
        logits = model(**call).logits.float()
    for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        ref = alone(model, batch["input_ids"][i, :n].numpy())
        torch.testing.assert_close(logits[i, :n], ref, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# check_isolation
# ---------------------------------------------------------------------------------------------


def test_check_isolation_passes_with_use_cache_false(model):
    assert model.config.use_cache is False
    report = check_isolation(model)
    assert max(report["max_abs_diff"]) < 1e-3
    check_isolation(model, via_collator=True)


def test_check_isolation_catches_use_cache_default(model):
    model.config.use_cache = True  # the transformers default
    try:
        with pytest.raises(PackingIsolationError, match="use_cache"):
            check_isolation(model)
        # explicitly passing use_cache=False (as the collators do) fixes it
        check_isolation(model, forward_kwargs={"use_cache": False})
        check_isolation(model, via_collator=True)
    finally:
        model.config.use_cache = False


def test_check_isolation_catches_all_ones_mask(model):
    mask = torch.ones(1, 24 + 17, dtype=torch.long)
    with pytest.raises(PackingIsolationError, match="attention_mask"):
        check_isolation(model, forward_kwargs={"attention_mask": mask})


def test_register_varlen_attention():
    name = register_varlen_attention()
    if not torch.cuda.is_available():
        assert name is None
    else:
        assert isinstance(name, str)


def test_varlen_adapter_with_reference_kernel(model, dataset, monkeypatch):
    """The varlen_attn adapter (layout, GQA, causality, cu_seq_lens) against per-sequence SDPA.

    torch's varlen_attn kernel is CUDA-only; here a reference with its signature stands in for it
    (the real kernel is checked in bf16 on a GPU by benchmarks/bench_train.py --exactness).
    """
    import torch.nn.attention.varlen as varlen_mod

    calls = []

    def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                              scale=None, window_size=(-1, -1), enable_gqa=False):
        assert tuple(window_size) == (-1, 0) and isinstance(max_q, int)
        assert cu_seq_q.dtype == torch.int32
        calls.append(cu_seq_q.tolist())
        out = torch.empty_like(query)
        cu = cu_seq_q.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            q, k, v = (x[a:b].transpose(0, 1)[None] for x in (query, key, value))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                 enable_gqa=enable_gqa)
            out[a:b] = o[0].transpose(0, 1)
        return out

    monkeypatch.setattr(varlen_mod, "varlen_attn", reference_varlen_attn)
    name = register_varlen_attention("packprep_varlen_test", require_cuda=False)
    assert name == "packprep_varlen_test"
    model.set_attn_implementation(name)
    try:
        batch = collate_packed([dataset[0], dataset[1]])
        logits = forward_logits(model, batch)[0]
        assert calls and calls[0] == batch["cu_seq_lens_q"].tolist()
        cu = batch["cu_seq_lens_q"].tolist()
        ids = batch["input_ids"][0].numpy()
        model.set_attn_implementation("sdpa")
        for a, b in zip(cu[:-1], cu[1:]):
            torch.testing.assert_close(logits[a:b], alone(model, ids[a:b]), atol=ATOL, rtol=0)
        # without cu_seq_lens the adapter derives the boundaries from restarted position_ids
        model.set_attn_implementation(name)
        calls.clear()
        raw = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
        torch.testing.assert_close(forward_logits(model, raw)[0], logits, atol=ATOL, rtol=0)
        assert calls[0] == cu
        check_isolation(model)
    finally:
        model.set_attn_implementation("sdpa")


def test_model_call_with_whole_batch(model, dataset):
    # model(**batch) works as is (every key is a model argument); its loss is the per-token mean
    batch = collate_packed([dataset[0], dataset[1]])
    assert "num_supervised_tokens" not in batch
    with torch.no_grad():
        loss = model(**batch).loss
    logits = forward_logits(model, batch)[0]
    seq_lens = np.concatenate([dataset[0]["seq_lens"], dataset[1]["seq_lens"]])
    ref = seq_loss_sum(logits, batch["labels"][0]) / num_supervised_tokens(batch["labels"][0], seq_lens)
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=1e-5)


def test_real_writer_shards(tmp_path):
    """Shards written by packprep.pack read back through PackedDataset and the collator."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    chats, tok = os.path.join(root, "examples", "chats.jsonl"), os.path.join(root, "examples", "tokenizer")
    try:
        from packprep import pack
    except ImportError as exc:
        pytest.skip(f"packprep.pack unavailable: {exc}")
    if not (os.path.exists(chats) and os.path.isdir(tok)):
        pytest.skip("examples/chats.jsonl or examples/tokenizer missing")
    pack(chats, str(tmp_path / "out"), tokenizer=tok, max_len=256, num_proc=1)
    ds = PackedDataset(tmp_path / "out")
    assert len(ds) > 0 and ds.max_len == 256
    for i in range(min(len(ds), 20)):
        row = ds[i]
        batch = collate_packed([row])  # validates restarted positions and seq_lens
        assert batch["input_ids"].shape[1] == int(row["seq_lens"].sum()) <= 256
        # the writer already puts -100 at every sequence start: the collator changes nothing
        np.testing.assert_array_equal(batch["labels"][0].numpy(), row["labels"])


def test_import_loads_neither_numba_nor_pyarrow():
    import subprocess
    import sys

    code = "import packprep.training, sys; assert 'numba' not in sys.modules and 'pyarrow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_seq_lens_reads_only_that_column(dataset, monkeypatch):
    from packprep.layout import ShardReader

    read = []
    original = ShardReader.read
    monkeypatch.setattr(ShardReader, "read", lambda self, columns=None: read.append(columns) or original(self, columns))
    fresh = PackedDataset(dataset.files)
    lens = fresh.seq_lens()
    assert read and all(columns == ["seq_lens"] for columns in read)
    assert [x.tolist() for x in lens] == [dataset[i]["seq_lens"].tolist() for i in range(len(dataset))]


def test_dataset_reads_a_renamed_layout(tmp_path):
    """A folder exported for TRL (seq_lens stored as seq_lengths) reads back with canonical names."""
    from packprep.layout import get_layout

    rows = make_rows(seed=2, n_rows=2)
    write_shards(tmp_path, rows, n_shards=1)
    shard = next((tmp_path / "data").iterdir())
    pq.write_table(get_layout("trl").to_layout(pq.read_table(shard), None), shard)
    manifest = json.loads((tmp_path / "packprep.json").read_text())
    (tmp_path / "packprep.json").write_text(json.dumps({**manifest, "layout": "trl"}))
    ds = PackedDataset(tmp_path)
    np.testing.assert_array_equal(ds[1]["seq_lens"], rows[1]["seq_lens"])
    assert [x.tolist() for x in ds.seq_lens()] == [r["seq_lens"].tolist() for r in rows]
