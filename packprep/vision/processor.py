"""The model's own processor: loaded from the tokenizer folder, asked what each image becomes.

transformers' processors expand each image placeholder of the rendered text into the text their
``replace_image_token`` writes for that image (``ProcessorMixin.get_text_with_replacements``), then
tokenize the whole text. packprep does the same on its rendered sequences, so the count and layout of
image tokens are the processor's by construction. What an image becomes depends on its size only (the
processors resize from the size: min/max pixels, grids, crops), so the processor runs once per distinct
size and the answer is kept.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, Rejected

MROPE_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")  # get_rope_index of modeling_qwen2(_5)_vl


def has_image_processor(folder: str) -> bool:
    """Whether a tokenizer folder also holds an image processor (its ``preprocessor_config.json`` or a
    ``processor_config.json`` naming one)."""
    path = Path(folder)
    return path.is_dir() and (path / "preprocessor_config.json").is_file()


def load_processor(folder: str):
    """``AutoProcessor.from_pretrained(folder)``; a processor with a video part that cannot load here
    (transformers' video processors need torchvision) is made without it: images never use it."""
    import importlib.util

    if importlib.util.find_spec("PIL") is None:
        raise ConfigError(f"{folder} holds an image processor, and reading images needs Pillow: "
                          "pip install 'packprep[vision]'")
    try:
        from transformers import AutoProcessor

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoProcessor.from_pretrained(folder)
    except ImportError as exc:
        if "video" not in str(exc).lower() and "torchvision" not in str(exc).lower():
            raise ConfigError(f"cannot load the processor of {folder}: {exc}") from None
        return _without_video(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"cannot load the processor of {folder} with transformers' AutoProcessor: "
                          f"{str(exc).splitlines()[0][:300]}") from None


def _without_video(folder: str):
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import processor_class_from_name

    config = json.loads((Path(folder) / "preprocessor_config.json").read_text(encoding="utf-8"))
    cls = processor_class_from_name(config.get("processor_class", ""))
    if cls is None or "video_processor" not in cls.get_attributes():
        raise ConfigError(f"cannot load the processor of {folder} ({config.get('processor_class')!r})")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = cls.__new__(cls)
    processor.check_argument_for_proper_class = lambda name, value: None  # None for the video part
    cls.__init__(processor, image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tokenizer,
                 video_processor=None, chat_template=tokenizer.chat_template)
    del processor.check_argument_for_proper_class
    return processor


@dataclass(frozen=True)
class Expansion:
    """What the processor writes for one image in place of its placeholder."""

    text: str
    tokens: int  # how many of the model's image tokens it holds
    grid: tuple[int, ...]  # the processor's grid (image_grid_thw; rows, cols; num_crops)


class ImageTokens:
    """The processor's answers for a run: the placeholder, the image token ids, each size's expansion."""

    def __init__(self, processor):
        if not all(hasattr(processor, name) for name in ("replace_image_token", "_process_images", "image_token")):
            import transformers

            raise ConfigError(f"{type(processor).__name__} of transformers {transformers.__version__} does not say "
                              "what it writes for an image (replace_image_token): packing images needs a newer "
                              "transformers (5.25 is the one tested)")
        self.processor = processor
        self.placeholder: str = processor.image_token
        self.token_ids: list[int] = [int(i) for i in processor.image_token_ids if i is not None]
        self.token_strings = processor.tokenizer.convert_ids_to_tokens(self.token_ids)
        self.mrope = type(processor).__name__ in MROPE_PROCESSORS
        self.merge_size = int(getattr(processor.image_processor, "merge_size", 1) or 1)
        self._sizes: dict[tuple[int, int], Expansion] = {}
        tokenizer_kwargs = getattr(processor.tokenizer, "init_kwargs", {})
        self._kwargs = processor._merge_kwargs(tokenizer_init_kwargs=tokenizer_kwargs)["images_kwargs"]

    @property
    def family(self) -> str:
        return type(self.processor).__name__

    def expansion(self, image) -> Expansion:
        """The processor's text for ``image`` (a PIL image), asked once per size."""
        key = image.size
        if key not in self._sizes:
            self._sizes[key] = self.run(image)
        return self._sizes[key]

    def run(self, image) -> Expansion:
        """The processor run on ``image`` itself (``verify`` does this for every image)."""
        try:
            images = self.processor.prepare_inputs_layout(images=[image], text=[self.placeholder])[0]
            processed, replacements = self.processor._process_images(images, **self._kwargs)
        except (ValueError, TypeError, RuntimeError, ZeroDivisionError, OverflowError) as exc:
            raise Rejected(f"the processor refuses it: {str(exc).splitlines()[0][:200]}",
                           "image_refused_by_processor") from None
        text = replacements[0]
        tokens = sum(text.count(t) for t in self.token_strings)
        return Expansion(text, tokens, _grid(processed))


def _grid(processed: dict) -> tuple[int, ...]:
    """The processor's own grid for its one image."""
    if "image_grid_thw" in processed:
        return tuple(int(v) for v in np.asarray(processed["image_grid_thw"])[0])
    if "rows" in processed:
        return int(np.ravel(processed["rows"])[0]), int(np.ravel(processed["cols"])[0])
    if "num_crops" in processed:
        return (int(np.ravel(processed["num_crops"])[0]),)
    return ()


def rope_index(input_ids: np.ndarray, grids: list[tuple[int, ...]], image_ids: list[int],
               merge_size: int) -> np.ndarray:
    """(3, L) int32 M-RoPE positions of one sequence, as transformers' Qwen2.5-VL ``get_rope_index``
    computes them for it alone (images only: consecutive image tokens are one image, in order)."""
    is_image = np.isin(input_ids, image_ids)
    out = np.empty((3, len(input_ids)), dtype=np.int64)
    edges = np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(input_ids)]
    current, grid_iter = 0, iter(grids)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if not is_image[start]:
            out[:, start:stop] = np.arange(current, current + stop - start)
            current += stop - start
            continue
        t, h, w = next(grid_iter)
        gh, gw = h // merge_size, w // merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh) + current, np.arange(gw) + current, indexing="ij")
        out[:, start:stop] = np.stack([tt.ravel() + current, hh.ravel(), ww.ravel()])
        current += max(h, w) // merge_size
    return out.astype(np.int32)


def describe(processor) -> dict[str, Any]:
    """For the manifest: the processor class and what decides an image's tokens."""
    image = processor.image_processor
    keys = ("min_pixels", "max_pixels", "patch_size", "merge_size", "size", "max_image_size",
            "do_image_splitting", "do_pan_and_scan", "image_seq_length")
    found = {k: getattr(image, k, None) for k in keys}
    return {"processor": type(processor).__name__, "image_processor": type(image).__name__,
            **{k: _plain(v) for k, v in found.items() if v is not None and not callable(v)}}


def _plain(value: Any) -> Any:
    """A setting as JSON holds it (transformers' SizeDict: its fields that are set)."""
    if hasattr(value, "__dataclass_fields__"):
        return {k: v for k, v in vars(value).items() if v is not None}
    return json.loads(json.dumps(value, default=str))
