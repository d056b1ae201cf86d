"""The compute cost of a packed row, from its sequence lengths alone (pure; no torch).

A row of sequences ``l_1..l_k`` costs ``per_token * sum(l) + per_square * sum(l**2) + per_sequence * k``:
the linear layers' work grows with the tokens, causal attention's with each sequence's length
squared (varlen attention never looks across a packed boundary), and each sequence may carry a
fixed overhead. Two rows of ``max_len`` tokens differ only in the last two terms: one 32k sequence
costs far more than sixty-four of 512 (measured 2.4x on a 1B Llama, issue 26).

:func:`model_cost` derives the coefficients from a transformers ``config.json`` as training FLOPs:
the forward's matmuls (2 FLOPs a multiply-add) times 3 for the linear layers (the backward does two
matmuls for the forward's one) and times 3.5 for attention (FlashAttention's backward does five
matmuls against the forward's two). The units cancel in every use here (ratios of costs), so a fit
of measured seconds (``CostModel(per_token, per_square, per_sequence)``) serves as well.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from .errors import ConfigError

# The shape assumed without --model-config: Llama-3.2-1B (hidden 2048, 16 layers, 32 query and 8
# key/value heads of 64, MLP 8192, vocabulary 128256). Larger models spend a smaller share on attention.
DEFAULT_SHAPE = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}


@dataclass(frozen=True)
class CostModel:
    """Cost of a row = ``per_token * tokens + per_square * sum(len**2) + per_sequence * sequences``."""

    per_token: float
    per_square: float
    per_sequence: float = 0.0
    source: str = "fit"  # where the coefficients come from: a config path, "default", "fit"

    def row_costs(self, entry_lengths, offsets) -> np.ndarray:
        """Cost of each row of a CSR layout: ``entry_lengths`` grouped by ``offsets`` (``n_rows + 1``)."""
        per_entry = self.sequence_costs(entry_lengths)
        sums = np.zeros(per_entry.shape[0] + 1)
        np.cumsum(per_entry, out=sums[1:])
        offsets = np.asarray(offsets)
        return sums[offsets[1:]] - sums[offsets[:-1]]

    def sequence_costs(self, lengths) -> np.ndarray:
        """Cost of each sequence on its own (a row's cost is the sum over its sequences)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.per_token * lengths + self.per_square * lengths * lengths + self.per_sequence

    def attention_share(self, entry_lengths) -> float:
        """The share of the squared term in the cost of these sequences."""
        lengths = np.asarray(entry_lengths, dtype=np.float64)
        total = float(self.sequence_costs(lengths).sum())
        return float(self.per_square * np.square(lengths).sum() / total) if total else 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def shape_cost(shape: dict, source: str = "default") -> CostModel:
    """Training FLOPs per token and per squared sequence length of a decoder of this shape."""
    h = int(shape["hidden_size"])
    layers = int(shape["num_hidden_layers"])
    heads = int(shape["num_attention_heads"])
    kv_heads = int(shape.get("num_key_value_heads") or heads)
    head_dim = int(shape.get("head_dim") or h // heads)
    inter = int(shape["intermediate_size"])
    vocab = int(shape.get("vocab_size") or 0)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    # multiply-adds per token: q, k, v, o projections, a gated MLP (3 matrices), then the LM head
    macs = layers * (h * q_width + 2 * h * kv_width + q_width * h + 3 * h * inter) + h * vocab
    # causal attention, per layer: QK^T and AV over half the l*l pairs, q_width wide: l*l*q_width MACs
    square_macs = layers * q_width
    return CostModel(per_token=6.0 * macs, per_square=7.0 * square_macs, source=source)


def read_model_shape(config_path: str | os.PathLike) -> tuple[dict, str]:
    """The decoder's shape in the transformers ``config.json`` at ``config_path`` (a folder holding one
    works too), and the file's path; its numbers are checked by ``settings.check_model_config``."""
    path = os.path.join(config_path, "config.json") if os.path.isdir(config_path) else os.fspath(config_path)
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model-config {path}: cannot read a JSON model config ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("text_config") or {}, dict):
        what = "its text_config is not an object" if isinstance(config, dict) else "it is not a JSON object"
        raise ConfigError(f"--model-config {path}: {what}; give a transformers config.json of a decoder "
                          "(Llama, Qwen, Mistral...)")
    config = config.get("text_config") or config  # a multimodal config keeps the decoder's shape there
    missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
               if isinstance(config.get(key), bool) or not isinstance(config.get(key), int)]
    if missing:
        raise ConfigError(f"--model-config {path}: no integer {', '.join(missing)}; give a transformers "
                          "config.json of a decoder (Llama, Qwen, Mistral...)")
    return config, str(path)


def model_cost(config_path: str | os.PathLike | None = None) -> CostModel:
    """The cost model of the transformers ``config.json`` at ``config_path`` (a folder holding one
    works too), or of :data:`DEFAULT_SHAPE` when None."""
    if config_path is None:
        return shape_cost(DEFAULT_SHAPE, "default")
    return shape_cost(*read_model_shape(config_path))
