"""Shared-prefix rows train every turn as the flat exact rows do, at a fraction of the tokens.

The prefix tree is checked on literal lists (packprep.prefix_tree); then, for templates that
rewrite history (Qwen3, DeepSeek-R1-Distill-Qwen, QwQ), a tiny Llama-shaped model in float32 gives
every turn's loss and every parameter gradient from one shared-prefix row equal to those of the
flat exact sequences run one by one, through a plain loop and through transformers' Trainer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from packprep.layout import IGNORE_INDEX
from packprep.normalize import FieldNames, detect_format, normalize
from packprep.prefix_tree import TreeRow, bound, build_tree, build_trees, check_tree, locate, paths
from packprep.template_fit import fit_to_template
from packprep.tokenization import ChatEncoder, load_tokenizer

from .conftest import needs_fixtures

I = IGNORE_INDEX
FAMILIES = ["qwen3", "deepseek-r1-distill-qwen", "qwq"]

# three flat sequences: two branch after token 3, the third shares [6, 7] with the second
SEQUENCES = [([1, 2, 3, 4, 5], [I, I, I, 4, 5]), ([1, 2, 3, 6, 7, 8, 9], [I, I, I, I, I, 8, 9]),
             ([1, 2, 3, 6, 7, 10], [I, I, I, I, I, 10])]


def test_tree_of_literal_sequences():
    tree = build_tree(SEQUENCES)
    # 3 is repeated at the head of the second branch, 7 at the head of the third: a label at a
    # branch's first token (6, 10) is predicted from the stored token before it, the copy
    assert tree.input_ids.tolist() == [1, 2, 3, 4, 5, 3, 6, 7, 8, 9, 7, 10]
    assert tree.labels.tolist() == [I, I, I, 4, 5, I, I, I, 8, 9, I, 10]
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 4, 5]
    assert tree.descendants.tolist() == [11, 10, 2, 1, 0, 6, 5, 2, 1, 0, 1, 0]
    assert check_tree(tree) is None and tree.branches == 2
    assert [(i.tolist(), l.tolist()) for i, l in paths(tree)] == [(list(i), list(l)) for i, l in SEQUENCES]
    assert len(tree) == 12 <= bound(SEQUENCES) == 7 + (2 + 1) + (1 + 1)
    # each trained token's place: the stored token before it is the token before it in its sequence
    for ids, labels in SEQUENCES:
        at, trained = locate(tree, ids), np.flatnonzero(np.array(labels) != I)
        assert tree.input_ids[at].tolist() == ids and tree.labels[at[trained]].tolist() == ids[trained[0]:]
        assert tree.input_ids[at[trained] - 1].tolist() == [ids[j - 1] for j in trained]


def test_tree_merges_labels_and_roots():
    # a token trained in one sequence and not in another that holds it is trained once; sequences
    # with different first tokens are separate roots, each first label -100
    tree = build_tree([([5, 6, 7], [I, 6, 7]), ([5, 6, 8], [I, I, 8]), ([9, 6], [9, 6])])
    assert tree.input_ids.tolist() == [5, 6, 7, 6, 8, 9, 6]
    assert tree.labels.tolist() == [I, 6, 7, I, 8, I, 6]
    assert tree.position_ids.tolist() == [0, 1, 2, 1, 2, 0, 1]
    assert tree.descendants.tolist() == [4, 1, 0, 1, 0, 1, 0]
    assert check_tree(tree) is None
    assert len(build_tree([([1, 2], [I, 2]), ([1, 2], [I, 2])])) == 2  # the same sequence twice: once


def test_tree_longer_than_max_len_is_split_at_branch_points():
    # 12 tokens do not fit 9: the first sequence alone, then the two that share [1, 2, 3, 6, 7], each
    # tree with the prefix its branches need; every trained token kept, every tree checked
    first, rest = build_trees(SEQUENCES, 9)
    assert first.input_ids.tolist() == [1, 2, 3, 4, 5] and first.labels.tolist() == [I, I, I, 4, 5]
    assert rest.input_ids.tolist() == [1, 2, 3, 6, 7, 8, 9, 7, 10]
    assert rest.labels.tolist() == [I, I, I, I, I, 8, 9, I, 10]
    assert rest.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5]
    assert rest.descendants.tolist() == [8, 7, 6, 5, 2, 1, 0, 1, 0]  # 7, 8, 9; its copy is a sibling
    assert all(check_tree(t) is None for t in (first, rest))
    assert [(i.tolist(), l.tolist()) for t in (first, rest) for i, l in paths(t)] == [
        (list(i), list(l)) for i, l in SEQUENCES]
    assert [len(t) for t in build_trees(SEQUENCES, 12)] == [12]  # it fits: one tree
    # a sequence longer than max_len is a tree of its own, its flat sequence: only it is cut (as flat rows cut it)
    trees = build_trees(SEQUENCES, 6)
    assert [t.input_ids.tolist() for t in trees] == [list(ids) for ids, _ in SEQUENCES]
    assert [t.labels.tolist() for t in trees] == [list(labels) for _, labels in SEQUENCES]


@pytest.mark.parametrize("broken, why", [
    (dict(labels=[I, I, I, 4, 5, 3, I, I, 8, 9, I, 10]), "branch head is trained"),
    (dict(position_ids=[0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 5, 6]), "depth"),
    (dict(descendants=[11, 10, 2, 1, 0, 6, 5, 2, 1, 0, 2, 0]), "past the row"),
    (dict(descendants=[11, 4, 2, 1, 0, 6, 5, 2, 1, 0, 1, 0]), "nesting"),
    (dict(input_ids=[1, 2, 3, 4, 5, 4, 6, 7, 8, 9, 7, 10]), "copy of its branch point"),
])
def test_check_tree_finds_broken_rows(broken, why):
    tree = build_tree(SEQUENCES)
    columns = {k: np.array(broken.get(k, getattr(tree, k).tolist()), np.int32) for k in tree.__dict__}
    assert why in check_tree(TreeRow(**columns))


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_llama(vocab: int, attn: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      initializer_range=0.5)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def token_losses(model, ids, labels, **extra):
    """The causal-LM loss of every token (0 where untrained), unshifted: index t is label t."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False, **extra).logits[0]
    target = torch.tensor(labels)
    losses = torch.nn.functional.cross_entropy(logits[:-1], target[1:].clamp(min=0), reduction="none")
    return torch.cat([torch.zeros(1), torch.where(target[1:] != I, losses, 0.0)])


def relative(got, expected) -> float:
    """The relative difference of two gradients (float32 sums in another order differ by ~1e-7)."""
    return float((got - expected).norm() / expected.norm())


def turns(labels) -> list[np.ndarray]:
    """Each trained run of a sequence (a turn's target): its token indices."""
    trained = np.flatnonzero(np.asarray(labels)[1:] != I) + 1
    return np.split(trained, np.flatnonzero(np.diff(trained) > 1) + 1) if len(trained) else []


def test_literal_tree_loss_equals_flat():
    """The shifted-label hazard on literal tensors: 6 and 10 are predicted from their branch points."""
    from packprep.training import collate_tree, register_tree_attention

    flat_model = tiny_llama(16, "eager")
    tree_model = tiny_llama(16, register_tree_attention())
    batch = collate_tree({"input_ids": build_tree(SEQUENCES).input_ids, **_columns(build_tree(SEQUENCES))})
    tree = token_losses(tree_model, batch["input_ids"][0].tolist(), batch["labels"][0].tolist(),
                        position_ids=batch["position_ids"], tree_descendants=batch["tree_descendants"])
    expected = [float(token_losses(flat_model, ids, labels).sum().detach()) for ids, labels in SEQUENCES]
    assert float(tree[3:5].sum()) == pytest.approx(expected[0], rel=1e-5)
    assert float(tree[8:10].sum()) == pytest.approx(expected[1], rel=1e-5)
    assert float(tree[11]) == pytest.approx(expected[2], rel=1e-5)


def test_flex_mask_equals_dense_mask():
    """The FlexAttention mask_mod (what runs on GPU) and the dense mask (CPU training) agree."""
    from packprep.training.tree import tree_dense_attention, tree_flex_attention

    descendants = torch.from_numpy(build_tree(SEQUENCES * 30).descendants)  # rows of several trees
    descendants = torch.cat([descendants, descendants])
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, len(descendants), 16) for _ in range(3))
    dense = tree_dense_attention(q, k, v, descendants)
    assert torch.allclose(tree_flex_attention(q, k, v, descendants), dense, atol=1e-5)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(causal, dense, atol=1e-3)  # the tree is not the plain causal mask


def _columns(tree: TreeRow) -> dict:
    return {"labels": tree.labels, "position_ids": tree.position_ids, "tree_descendants": tree.descendants}


def _call(name, arguments, id_):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


RECORDS = [
    {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisor but 1 and 7."},
        {"role": "user", "content": "Is 9?"}, {"role": "assistant", "content": "<think>\n9 = 3 * 3.\n</think>\n\nNo."},
        {"role": "user", "content": "Is 11?"},
        {"role": "assistant", "content": "Yes, 11 is prime.", "reasoning_content": "No divisor up to 3."}]},
    {"tools": [{"type": "function", "function": {"name": "weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
         "tool_calls": [_call("weather", {"city": "Paris"}, "call_1")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": "Paris: 18C.", "reasoning_content": "Report it."},
        {"role": "user", "content": "And Oslo?"},
        {"role": "assistant", "content": "Oslo: 5C, I guess.", "reasoning_content": "No tool this time."}]},
]


def encoded_records(folder):
    tokenizer = load_tokenizer(folder)
    encoder = ChatEncoder(tokenizer, turn_context="exact")
    policy = fit_to_template(encoder.template.render)
    records = [normalize(json.loads(json.dumps(r)), detect_format(r), FieldNames(), policy) for r in RECORDS]
    return [[(ids.tolist(), labels.tolist()) for ids, labels in e.sequences] for e in encoder.encode(records)]


@pytest.fixture(scope="module")
def prepared(template_folder):
    """Per family: each record's flat exact sequences and its tree, ids renumbered into a small vocabulary."""
    out = {}
    for family in FAMILIES:
        records = encoded_records(template_folder(family))
        vocab = {t: n for n, t in enumerate(sorted({t for seqs in records for ids, _ in seqs for t in ids}))}
        remap = [[([vocab[t] for t in ids], [vocab[t] if t != I else I for t in labels]) for ids, labels in seqs]
                 for seqs in records]
        out[family] = (remap, [build_tree(seqs) for seqs in remap], len(vocab))
    return out


@needs_fixtures
@pytest.mark.parametrize("family", FAMILIES)
def test_every_turn_loss_and_gradient_equal_flat(family, prepared):
    from packprep.training import collate_tree, register_tree_attention

    records, trees, vocab = prepared[family]
    assert all(check_tree(t) is None for t in trees) and sum(t.branches for t in trees) >= 2
    flat_model, tree_model = tiny_llama(vocab, "eager"), tiny_llama(vocab, register_tree_attention())
    flat_total, tree_total, compared = 0.0, 0.0, 0
    batch = collate_tree([{"input_ids": t.input_ids, **_columns(t)} for t in trees])
    tree_losses = token_losses(tree_model, batch["input_ids"][0].tolist(), batch["labels"][0].tolist(),
                               position_ids=batch["position_ids"], tree_descendants=batch["tree_descendants"])
    offset, seen = 0, set()
    for seqs, tree in zip(records, trees):
        for ids, labels in seqs:
            flat = token_losses(flat_model, ids, labels)
            flat_total = flat_total + flat.sum()
            at = locate(tree, ids) + offset
            for turn in turns(labels):  # every turn's loss: the same tokens, the same value
                assert not seen & set(at[turn].tolist())  # no token trained twice
                seen |= set(at[turn].tolist())
                assert float(tree_losses[at[turn]].sum()) == pytest.approx(float(flat[turn].sum()), rel=1e-5)
                compared += 1
        offset += len(tree)
    tree_total = tree_losses.sum()
    assert len(seen) == int((batch["labels"] != I).sum())  # and nothing else is trained in the tree
    flat_total.backward()
    tree_total.backward()
    for (name, a), (_, b) in zip(flat_model.named_parameters(), tree_model.named_parameters()):
        assert relative(b.grad, a.grad) < 1e-5, name
    assert compared >= 6


@needs_fixtures
@pytest.mark.parametrize("family", ["qwen3"])
def test_trainer_recipe_gradient_equals_flat(family, prepared, tmp_path):
    """transformers' Trainer with collate_tree: one training step's gradients are the flat rows'."""
    import datasets

    from packprep.training import collate_packed, collate_tree, register_tree_attention

    records, trees, vocab = prepared[family]
    grads = {}
    for form in ("flat", "tree"):
        if form == "tree":
            rows = [{"input_ids": t.input_ids.tolist(), **{k: v.tolist() for k, v in _columns(t).items()}}
                    for t in trees]
            model, collator = tiny_llama(vocab, register_tree_attention()), collate_tree
        else:
            rows = [{"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids)))}
                    for seqs in records for ids, labels in seqs]
            model, collator = tiny_llama(vocab, "sdpa"), collate_packed
        args = transformers.TrainingArguments(output_dir=str(tmp_path / form), per_device_train_batch_size=len(rows),
                                              report_to=[], use_cpu=True, remove_unused_columns=False,
                                              learning_rate=0.0, max_steps=1, save_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                       data_collator=collator)
        trainer.train()
        batch = next(iter(trainer.get_train_dataloader()))
        model.zero_grad()
        trainer.training_step(model, batch, num_items_in_batch=int((batch["labels"][:, 1:] != I).sum()))
        grads[form] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, flat in grads["flat"].items():
        assert relative(grads["tree"][name], flat) < 1e-5, name


@pytest.fixture(scope="module")
def packed(template_folder, tmp_path_factory):
    """RECORDS packed with Qwen3 as flat exact rows and as shared-prefix rows."""
    import packprep

    root = tmp_path_factory.mktemp("shared-prefix")
    data = root / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 3), encoding="utf-8")
    folder = template_folder("qwen3")
    for name, extra in (("flat", {}), ("tree", {"shared_prefix": True})):
        packprep.pack([str(data)], str(root / name), tokenizer=folder, max_len=1024, num_proc=1, **extra)
    return root


def _by_record(folder) -> dict:
    from packprep.training import PackedDataset

    out: dict = {}
    for row in PackedDataset(str(folder)):
        start = 0
        for length, source in zip(row["seq_lens"].tolist(), row["source_index"].tolist()):
            piece = {k: v[start : start + length] for k, v in row.items() if k not in ("seq_lens", "source_index")}
            out.setdefault(source, []).append(piece)
            start += length
    return out


@needs_fixtures
def test_pack_writes_each_record_as_its_tree(packed):
    import packprep

    flat, tree = json.loads((packed / "flat" / "packprep.json").read_text()), json.loads(
        (packed / "tree" / "packprep.json").read_text())
    assert "shared_prefix" not in flat["config"] and flat["layout"] == "packprep"  # flat manifests as they were
    assert tree["config"]["shared_prefix"] is True and tree["layout"] == "packprep-tree"
    assert tree["tokens"]["supervised"] == flat["tokens"]["supervised"] and tree["tokens"]["total"] < flat["tokens"]["total"]
    assert "shared-prefix rows" in (packed / "tree" / "README.md").read_text()
    assert packprep.verify(str(packed / "tree")).ok
    flat_rows, tree_rows = _by_record(packed / "flat"), _by_record(packed / "tree")
    assert sorted(flat_rows) == sorted(tree_rows)
    for source, pieces in tree_rows.items():  # one row piece a record: its flat exact sequences as a tree
        (got,) = pieces
        tree = TreeRow(got["input_ids"], got["labels"], got["position_ids"], got["tree_descendants"])
        assert check_tree(tree) is None
        held = sorted(tuple(ids.tolist()) for ids, _ in paths(tree))
        assert held == sorted(tuple(p["input_ids"].tolist()) for p in flat_rows[source])
        for piece in flat_rows[source]:  # each flat sequence's trained tokens are trained in the tree
            at = locate(tree, piece["input_ids"])
            trained = np.flatnonzero(piece["labels"] != I)
            assert tree.labels[at[trained]].tolist() == piece["labels"][trained].tolist()
        assert int((tree.labels != I).sum()) == sum(int((p["labels"] != I).sum()) for p in flat_rows[source])


@needs_fixtures
def test_trees_longer_than_max_len_lose_no_turn(template_folder, tmp_path):
    """At --max-len 100, the first record's tree (112 tokens; its sequences 40, 53 and 75) is split
    into trees that fit, at branch points: nothing of it is cut. The second record's sequences
    (200, 217) are each longer, their turns past 100: left out as flat rows leave them, counted the same."""
    import packprep

    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    folder = template_folder("qwen3")
    manifests = {name: packprep.pack([str(data)], str(tmp_path / name), tokenizer=folder, max_len=100, num_proc=1,
                                     **extra) for name, extra in (("flat", {}), ("tree", {"shared_prefix": True}))}
    flat, tree = manifests["flat"], manifests["tree"]
    assert tree["tokens"]["supervised"] == flat["tokens"]["supervised"]
    cut = ("packed", "rejected", "turns_cut", "supervised_cut")
    assert [tree["counts"][k] for k in cut] == [flat["counts"][k] for k in cut] == [1, 1, 3, 65]
    assert packprep.verify(str(tmp_path / "tree")).ok
    flat_rows, tree_rows = _by_record(tmp_path / "flat"), _by_record(tmp_path / "tree")
    trees = [TreeRow(p["input_ids"], p["labels"], p["position_ids"], p["tree_descendants"]) for p in tree_rows[0]]
    assert len(trees) == 2 and all(len(t) <= 100 and check_tree(t) is None for t in trees)
    held = sorted(tuple(ids.tolist()) for t in trees for ids, _ in paths(t))
    assert held == sorted(tuple(p["input_ids"].tolist()) for p in flat_rows[0])
    # the cards say what was written: trees store no repeated context; flat rows' was cut by --max-len
    tree_card, flat_card = ((tmp_path / name / "README.md").read_text() for name in ("tree", "flat"))
    assert "prefix trees that store each shared prefix once" in tree_card and "repeated context" not in tree_card
    assert "tokens of repeated context as tokenized, before --max-len cut" in flat_card


@needs_fixtures
def test_verify_finds_a_broken_tree(packed, tmp_path):
    """A shard whose branch head is trained (the shifted-label hazard) fails verify, named."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    import packprep

    folder = tmp_path / "broken"
    shutil.copytree(packed / "tree", folder)
    shard = next((folder / "data").glob("train-*.parquet"))
    rows = pq.read_table(shard).to_pylist()
    row = rows[0]
    head = next(i for i in range(1, len(row["input_ids"])) if row["tree_descendants"][i - 1] == 0
                and row["position_ids"][i] > 0)
    row["labels"][head] = row["input_ids"][head]
    pq.write_table(pa.Table.from_pylist(rows, pq.read_table(shard).schema), shard)
    failures = packprep.verify(str(folder), check_hashes=False).failures
    assert any(f.check == "tree" and "branch head is trained" in f.message for f in failures), failures


@needs_fixtures
def test_stats_shows_the_three_costs(packed, template_folder):
    import packprep

    report = packprep.stats([str(packed / "records.jsonl")], template_folder("qwen3"), [1024], num_proc=1)
    policies = report["turn_context"]["policies"]
    tree = json.loads((packed / "tree" / "packprep.json").read_text())
    assert policies["exact"]["shared_prefix_tokens"] == tree["tokens"]["total"]
    assert policies["rendered"]["tokens"] < policies["exact"]["shared_prefix_tokens"] < policies["exact"]["tokens"]
    # the bound (one rendering, each earlier sequence's targets once more, a token a branch) is shown beside;
    # Qwen3's tool-call stretch stores its tool results once more (another context), a little over it
    assert policies["rendered"]["tokens"] < policies["exact"]["shared_prefix_bound"] < policies["exact"]["tokens"]


@needs_fixtures
def test_consumers_of_ordinary_rows_refuse_tree_rows(packed, tmp_path, template_folder):
    import packprep
    from packprep.errors import ConfigError
    from packprep.pipeline import repack
    from packprep.training import PackedDataset, TreeRowsError, collate_packed

    row = PackedDataset(str(packed / "tree"))[0]
    with pytest.raises(TreeRowsError, match="each branch would attend to its sibling"):
        collate_packed([row])
    with pytest.raises(ConfigError, match="not exported"):
        packprep.export(str(packed / "tree"), "trl", str(tmp_path / "trl"))
    with pytest.raises(ConfigError, match="cannot be repacked"):
        repack(str(packed / "tree"), str(tmp_path / "re"), max_len=2048)
    with pytest.raises(ConfigError, match="layout=\"trl\" would hand them"):
        packprep.pack([str(packed / "records.jsonl")], str(tmp_path / "x"), tokenizer=template_folder("qwen3"),
                      shared_prefix=True, layout="trl")
    from click.testing import CliRunner

    from packprep.cli import main

    result = CliRunner().invoke(main, ["pack", str(packed / "records.jsonl"), "-t", template_folder("qwen3"), "-o",
                                       str(tmp_path / "cli"), "--shared-prefix", "--turn-context", "intact"])
    assert result.exit_code != 0 and "nothing to share" in result.output
    with pytest.raises(ConfigError, match="nothing to share"):
        packprep.pack([str(packed / "records.jsonl")], str(tmp_path / "x"), tokenizer=template_folder("qwen3"),
                      shared_prefix=True, turn_context="rendered")


@needs_fixtures
def test_check_pipeline_on_tree_rows(packed, tmp_path):
    """The Trainer recipe passes check_pipeline; dropping the column or collating as ordinary rows is caught."""
    import datasets

    from packprep.training import (PackingIsolationError, TreeRowsError, check_pipeline, collate_packed,
                                   collate_tree, register_tree_attention)

    data = datasets.load_dataset(str(packed / "tree"), split="train")
    model = tiny_llama(151669, register_tree_attention())

    def trainer(collator, remove):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True,
                                              remove_unused_columns=remove)
        return transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)

    assert check_pipeline(trainer(collate_tree, False), data=str(packed / "tree"))["paths"] >= 2
    with pytest.raises(TreeRowsError, match="remove_unused_columns=False"):  # the column dropped: collate_tree says so
        check_pipeline(trainer(collate_tree, True), data=str(packed / "tree"))
    with pytest.raises(TreeRowsError, match="shared-prefix row"):
        check_pipeline(collate_packed, model, str(packed / "tree"))
    plain = tiny_llama(151669, "sdpa")
    with pytest.raises(PackingIsolationError, match="ignores tree_descendants"):
        check_pipeline(collate_tree, plain, str(packed / "tree"))


def test_hybrid_models_and_context_parallelism_are_refused():
    from types import SimpleNamespace

    from packprep.training import TreeRowsError, register_tree_attention
    from packprep.training.tree import refuse_context_parallel

    config = transformers.Lfm2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False,
                                     num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(TreeRowsError, match="a recurrent state cannot branch"):
        register_tree_attention(transformers.AutoModelForCausalLM.from_config(config))
    trainer = SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=2)))
    with pytest.raises(TreeRowsError, match="context parallelism"):
        refuse_context_parallel(trainer)
