"""packprep: chat conversations in, packed training-ready shards out.

Library first, CLI second: every ``packprep`` command is a thin wrapper over a function here.

>>> import packprep
>>> manifest = packprep.pack("chats.jsonl", "out/", tokenizer="path/to/tokenizer", max_len=4096)
>>> packprep.verify("out/").ok
True

The names below are imported on first use, so that ``import packprep`` (and ``packprep.training``)
stays light: numba, pyarrow and transformers load only when a step that needs them runs.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Bins": "packing",
    "pack_lengths": "packing",
    "PackConfig": "settings",
    "pack": "pipeline",
    "export": "convert",
    "push": "hub_upload",
    "stats": "length_stats",
    "verify": "verification",
}

__all__ = ["Bins", "PackConfig", "__version__", "export", "pack", "pack_lengths", "push", "stats", "verify"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'packprep' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

