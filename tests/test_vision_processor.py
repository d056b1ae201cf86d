"""The model's processor decides what an image becomes: packprep's expansion of a rendered conversation
is, token for token, what the processor itself gives for the same text and images (three families,
several sizes and aspect ratios), and the M-RoPE index is transformers' own."""

import numpy as np
import pytest
from PIL import Image

from packprep.vision.processor import ImageTokens, load_processor, rope_index

from .conftest import needs_fixtures, needs_vision_transformers
from .vision_folders import FAMILIES, build, draw_image

needs_vision_transformers()

pytestmark = needs_fixtures  # the fixtures' vocabularies and conversations

SIZES = [(300, 200), (64, 900), (1500, 1000), (28, 28)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    return {family: build(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expansion_is_the_processors_own(family, folders, tmp_path):
    processor = load_processor(str(folders[family]))
    tokens = ImageTokens(processor)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Shapes."}]}]
    text = processor.apply_chat_template(messages, tokenize=False)
    assert text.count(tokens.placeholder) == 1
    for n, size in enumerate(SIZES):
        image = Image.open(draw_image(tmp_path / f"{n}.png", size, n))
        expected = processor(text=[text], images=[[image]], add_special_tokens=False)["input_ids"][0]
        expansion = tokens.expansion(image)
        ours = processor.tokenizer(text.replace(tokens.placeholder, expansion.text), add_special_tokens=False)
        assert ours["input_ids"] == list(expected), (family, size)
        assert expansion.tokens == int(np.isin(expected, tokens.token_ids).sum()) > 0
        assert tokens.expansion(image.resize(size)) is expansion  # asked once per size


def test_rope_index_is_transformers_get_rope_index(folders, tmp_path):
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    processor = load_processor(str(folders["qwen2.5-vl"]))
    tokens = ImageTokens(processor)
    assert tokens.mrope
    images = [Image.open(draw_image(tmp_path / f"{n}.png", size, n)) for n, size in enumerate(SIZES[:3])]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}]},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, tokenize=False)
    out = processor(text=[text], images=images, add_special_tokens=False, return_mm_token_type_ids=True)
    ids = np.asarray(out["input_ids"][0])
    grids = [tokens.expansion(image).grid for image in images]
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2,
                                                                                 tokens_per_second=2)))
    model.get_vision_position_ids = lambda *a, **k: qwen.Qwen2_5_VLModel.get_vision_position_ids(model, *a, **k)
    expected, _ = qwen.Qwen2_5_VLModel.get_rope_index(
        model, torch.from_numpy(ids[None]), mm_token_type_ids=torch.tensor(out["mm_token_type_ids"]),
        image_grid_thw=torch.tensor(grids))
    assert np.array_equal(rope_index(ids, grids, tokens.token_ids, tokens.merge_size), expected[:, 0].numpy())


def test_a_template_kept_only_in_chat_template_json_is_read(folders, tmp_path):
    """Processor folders may keep the chat template in chat_template.json alone (the processor's file)."""
    import json
    import shutil

    import packprep

    from .vision_folders import conversation_set

    folder = tmp_path / "folder"
    shutil.copytree(folders["smolvlm"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data, expected = conversation_set(tmp_path / "data", 2)
    manifest = packprep.pack(str(data), str(tmp_path / "out"), str(folder), max_len=4096, num_proc=1)
    assert manifest["counts"]["packed"] == 2
