"""Bad images and bad image records among good ones: each is a counted rejection whose reason names the
record's image (number and source) and what is wrong; every other record is kept. And a tokenizer
without an image processor refuses records that carry images instead of training them as text."""

import io
import json

import pyarrow.parquet as pq
import pytest
from PIL import Image

import packprep
from packprep.errors import InputError

from .template_folders import build_folder
from .conftest import needs_fixtures, needs_vision_transformers
from .vision_folders import build, draw_image

needs_vision_transformers()

pytestmark = needs_fixtures  # the fixtures' vocabularies and conversations


def _chat(parts, answer="An answer."):
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def _image(ref):
    return {"type": "image", "image": ref}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build("qwen2.5-vl", tmp_path_factory.mktemp("qwen") / "folder")


def _bad_files(root):
    good = draw_image(root / "good.png", (320, 240), 1)
    data = good.read_bytes()
    (root / "truncated.png").write_bytes(data[: len(data) // 2])
    (root / "corrupt.png").write_bytes(b"not an image at all" * 10)
    (root / "empty.png").write_bytes(b"")
    Image.new("1", (10_000, 10_000)).save(root / "bomb.png")  # 100M pixels: over Pillow's MAX_IMAGE_PIXELS
    draw_image(root / "thin.png", (4000, 12), 2)  # aspect ratio over Qwen's limit of 200
    return good


CASES = {  # record -> (code, words its reason holds)
    "missing": (_chat([_image("nowhere.png"), {"type": "text", "text": "?"}]), "image_missing", "nowhere.png"),
    "truncated": (_chat([_image("truncated.png")]), "image_truncated", "truncated.png"),
    "corrupt": (_chat([_image("corrupt.png")]), "image_corrupt", "corrupt.png"),
    "empty": (_chat([_image("empty.png")]), "image_empty", "empty.png"),
    "bomb": (_chat([_image("bomb.png")]), "image_too_large", "bomb.png"),
    "over the processor's limits": (_chat([_image("thin.png")]), "image_refused_by_processor", "aspect ratio"),
    "remote": (_chat([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]), "image_remote",
               "https://example.com/cat.png"),
    "bad data URL": (_chat([_image("data:image/png;base64,@@@@")]), "image_corrupt", "base64"),
    "second image bad": (_chat([_image("good.png"), _image("nowhere.png")]), "image_missing", "image 1: nowhere.png"),
    "more placeholders than images": ({"conversations": [{"from": "human", "value": "<image><image> two?"},
                                                          {"from": "gpt", "value": "x"}], "images": ["good.png"]},
                                      "image_count_mismatch", "2 <image> placeholder(s) for 1 image(s)"),
    "more images than placeholders": ({"conversations": [{"from": "human", "value": "<image> one?"},
                                                          {"from": "gpt", "value": "x"}],
                                       "images": ["good.png", "good.png"]},
                                      "image_count_mismatch", "1 <image> placeholder(s) for 2 image(s)"),
    "placeholder spelled in text": (_chat([_image("good.png"), {"type": "text", "text": "<|image_pad|> hi"}]),
                                    "image_placeholder_in_text", "<|image_pad|>"),
    "image in an assistant turn": ({"messages": [{"role": "user", "content": "Draw."},
                                                 {"role": "assistant", "content": [_image("good.png")]}]},
                                   "image_in_assistant_turn", "assistant"),
}


def test_each_bad_image_is_a_counted_rejection_naming_it(qwen, tmp_path):
    _bad_files(tmp_path)
    good = _chat([_image("good.png"), {"type": "text", "text": "What is it?"}], "Shapes.")
    records = [good]
    for record, _, _ in CASES.values():
        records += [record, good]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = packprep.pack(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), str(qwen), max_len=2048)
    assert manifest["counts"]["packed"] == len(CASES) + 1
    assert manifest["counts"]["rejected"] == len(CASES)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    for (name, (_, code, words)), entry in zip(CASES.items(), rejects):
        assert entry["line"] == 2 * list(CASES).index(name) + 2, name
        assert entry["code"] == code and words in entry["reason"], (name, entry["reason"])
    images = [i for f in (tmp_path / "out" / "data").glob("*.parquet") for r in pq.read_table(f).to_pylist()
              for i in r["images"]]
    assert len(images) == len(CASES) + 1 and {i["source"] for i in images} == {"good.png"}


def test_an_image_is_never_cut(qwen, tmp_path):
    draw_image(tmp_path / "big.png", (1024, 768), 3)  # about 1,000 image tokens
    record = {"messages": [{"role": "user", "content": "Before the picture."},
                           {"role": "assistant", "content": "Noted."},
                           {"role": "user", "content": [_image("big.png"), {"type": "text", "text": "And this?"}]},
                           {"role": "assistant", "content": "Shapes."}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    for overlong, fate in (("truncate", "truncated"), ("drop", "rejected")):
        out = tmp_path / f"out-{overlong}"
        if overlong == "drop":
            with pytest.raises(InputError, match="never cut"):
                packprep.pack(str(tmp_path / "in.jsonl"), str(out), str(qwen), max_len=256, overlong=overlong)
            continue
        manifest = packprep.pack(str(tmp_path / "in.jsonl"), str(out), str(qwen), max_len=256, overlong=overlong)
        assert manifest["counts"][fate] == 1 and manifest["images"]["total"] == 1
        row = pq.read_table(next((out / "data").glob("*.parquet"))).to_pylist()[0]
        assert row["images"] == [] and len(row["input_ids"]) < 256  # cut before the image, not through it
        assert 151655 not in row["input_ids"]


def test_dataset_image_columns_are_read_as_bytes(qwen, tmp_path):
    datasets = pytest.importorskip("datasets")
    picture = Image.open(io.BytesIO(draw_image(tmp_path / "x.png", (200, 300), 4).read_bytes()))  # no file name: bytes
    features = datasets.Features({"messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                                  "images": datasets.Sequence(datasets.Image())})
    table = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "<image>What is it?"},
                                                      {"role": "assistant", "content": "Shapes."}]],
                                        "images": [[picture]]}, features=features)
    table.to_parquet(str(tmp_path / "in.parquet"))
    manifest = packprep.pack(str(tmp_path / "in.parquet"), str(tmp_path / "out"), str(qwen), max_len=1024)
    assert manifest["counts"]["packed"] == 1
    image = pq.read_table(next((tmp_path / "out" / "data").glob("*.parquet"))).to_pylist()[0]["images"][0]
    assert image["source"] == f"bytes:{image['sha256']}" and image["length"] > 0


def test_a_text_only_tokenizer_refuses_records_with_images(tmp_path):
    folder = build_folder("qwen3", tmp_path / "qwen3")
    records = [{"conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}],
                "image": "cat.png"},
               {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}}]},
                             {"role": "assistant", "content": "A cat."}]},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = packprep.pack(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), str(folder), max_len=512)
    assert manifest["counts"]["packed"] == 1
    assert manifest["counts"]["rejected_by_reason"] == {"images_without_processor": 2}
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert all("no image processor" in r for r in reasons)
