"""What the stack tests share: packed example data, its export, one-by-one references, a tiny model.

Every stack test packs the bundled example (``examples/chats.jsonl`` with the small-vocab
``examples/tokenizer``) once, exports it to that stack's layout, runs the stack's own loading and
collation code on it, and compares the packed rows' summed loss and logits with the same
sequences run one by one.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

MAX_LEN = 256
ROWS = 4  # packed rows compared per test (each holds several sequences)
LOSS_RTOL = 1e-5
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="session")
def canonical(tmp_path_factory):
    """The example packed in packprep's own layout (rows of at most MAX_LEN tokens)."""
    import packprep

    out = tmp_path_factory.mktemp("stacks") / "packed"
    packprep.pack(str(EXAMPLE_CHATS), str(out), tokenizer=str(EXAMPLE_TOKENIZER), max_len=MAX_LEN, num_proc=1)
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Llama and the example tokenizer saved as a model folder, for stacks that load one."""
    import shutil

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    tiny_llama(1739).save_pretrained(path)
    for f in EXAMPLE_TOKENIZER.iterdir():
        shutil.copy(f, path / f.name)
    return path


def canonical_rows(folder, n=ROWS) -> list[dict]:
    """The first ``n`` canonical rows (None: all), as dicts of lists."""
    table = pq.read_table(sorted((folder / "data").glob("*.parquet"))[0])
    return (table if n is None else table.slice(0, n)).to_pylist()


def sequences(rows: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) of every packed sequence of ``rows``, in order."""
    out = []
    for row in rows:
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])
        start = 0
        for n in row["seq_lens"]:
            out.append((ids[start : start + n], labels[start : start + n]))
            start += n
    return out


def per_sequence(logits, rows, shorter_by=0):
    """Split a batch's ``(rows, T, vocab)`` logits into each packed sequence's (each ``shorter_by`` tokens short)."""
    out = []
    for i, row in enumerate(rows):
        start = 0
        for n in row["seq_lens"]:
            out.append(logits[i, start : start + n - shorter_by])
            start += n - shorter_by
    return out


def one_by_one(rows, logits_of):
    """Summed next-token loss and per-sequence logits, each sequence run alone through ``logits_of``.

    ``logits_of(ids: LongTensor (1, n)) -> Tensor (n, vocab)``.
    """
    import torch
    import torch.nn.functional as F

    total, logits = 0.0, []
    for ids, labels in sequences(rows):
        with torch.no_grad():
            out = logits_of(torch.tensor(ids, dtype=torch.long)[None]).float()
        logits.append(out)
        total += F.cross_entropy(out[:-1], torch.tensor(labels[1:], dtype=torch.long), ignore_index=-100, reduction="sum").item()
    return total, logits


def assert_same(packed_loss, packed_logits, ref_loss, ref_logits):
    """Packed summed loss equals one-by-one (relative LOSS_RTOL); logits within LOGIT_ATOL."""
    assert len(packed_logits) == len(ref_logits)
    diff = max(float((a - b).abs().max()) for a, b in zip(packed_logits, ref_logits))
    assert abs(packed_loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (packed_loss, ref_loss)
    assert diff < LOGIT_ATOL, diff
    return diff


def tiny_llama(vocab_size: int, attn: str = "sdpa"):
    """A 2-layer Llama of hidden size 64, init std 0.5 so that any leak shows, fp32, eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * MAX_LEN, initializer_range=0.5,
        attn_implementation=attn, use_cache=False,
    )
    return LlamaForCausalLM(config).float().eval()


def export(folder, name, out):
    """``packprep export folder --to name out``; returns the path the stack is pointed at."""
    from packprep.convert import export as export_

    export_(folder, name, out)
    return out / "data" if name == "llamafactory" else out
