"""packprep: chat conversations in, packed training-ready shards out.

Library first, CLI second: every ``packprep`` command is a thin wrapper over a function here.

>>> import packprep
>>> manifest = packprep.pack("chats.jsonl", "out/", tokenizer="path/to/tokenizer", max_len=4096)
>>> packprep.verify("out/").ok
True
"""

__version__ = "0.1.0"

from .packing import Bins, pack_lengths  # noqa: E402
from .pipeline import PackConfig, pack  # noqa: E402
from .push import push  # noqa: E402
from .stats import stats  # noqa: E402
from .verify import verify  # noqa: E402

__all__ = ["Bins", "PackConfig", "__version__", "pack", "pack_lengths", "push", "stats", "verify"]
