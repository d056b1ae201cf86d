"""The ledger: where each input record ended up (packed, truncated, split or rejected, with the reason),
kept by every worker and merged by the driver, which writes the rejected ones to rejects.jsonl.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from .errors import listing, spell
from .fates import PACKED, REJECTED
from .normalize import Conversation, Rejected
from .read import Record
from .tokenization import Encoded


# what training each turn in its inference context costs (render.py): turns the whole rendering does
# not hold as at inference, sequences beyond one a record and their tokens, and turns trained only as
# the whole rendering writes them (turn_context rendered)
CONTEXT_COUNTS = ("turns_rewritten", "extra_sequences", "repeated_tokens", "turns_out_of_context")
# what --max-len cost the records: assistant turns it left without a trained token and the supervised
# tokens it removed (plan.cut_cost), in sequences kept, cut, or left out with nothing to train
CUT_COUNTS = ("turns_cut", "supervised_cut")


class RecordFailure(Exception):
    """A bad record under ``--on-error fail``; the driver names it (file, line) and stops."""

    def __init__(self, record: Record, reason: str):
        super().__init__(reason)
        self.record, self.reason = record, reason


class Ledger:
    """Where each record ended up. The driver's ledger writes rejected records to rejects.jsonl; a
    worker's ledger keeps them in ``entries`` for the driver to number and write."""

    def __init__(self, on_error: str = "skip", rejects_path=None):
        self.on_error = on_error
        self.rejects_path = rejects_path  # None: kept in entries (a worker), or only counted
        self.status = bytearray()  # the FATES index of each record: one byte a record
        self.reasons: Counter = Counter()
        self.turns_not_located = 0
        self.context: Counter = Counter()  # CONTEXT_COUNTS: what training every turn in its context costs
        self.cut: Counter = Counter()  # CUT_COUNTS: what --max-len cost
        self.changes: Counter = Counter()  # what normalize.py's transforms changed in the kept records
        self.formats: dict[int, Counter] = {}  # source number -> records of each format
        self.entries: list[dict] = []
        self.examples: dict[str, dict] = {}  # reason code -> its first rejection (written by the driver)
        self._handle = None

    def __enter__(self):
        if self.rejects_path is not None:
            self._handle = open(self.rejects_path, "w", encoding="utf-8")
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            self._handle.close()
            if not self.reasons:
                os.remove(self.rejects_path)

    def add(self) -> int:
        """Count a new record (packed until said otherwise); return its number."""
        self.status.append(PACKED)
        return len(self.status) - 1

    def accept(self, record: Record, number: int, item: "Encoded | Rejected") -> Encoded | None:
        """The encoded record, or None once a ``Rejected`` in its place is recorded (what a kept record
        brings is counted by :meth:`keep`)."""
        if isinstance(item, Rejected):
            self.reject(record, number, str(item), item.code)
            return None
        return item

    def keep(self, conversation: Conversation, encoded: Encoded) -> None:
        """Count what a record that is kept brings: normalizing changes, turns not located, and what
        its turns' contexts cost (the tokens of its sequences before the last, as encoded)."""
        self.changes.update(conversation.changes)
        self.changes.update(encoded.changes)  # what became of the turns' reasoning, once rendered
        self.changes["control_text_in_content"] += encoded.control_text
        self.turns_not_located += encoded.turns_not_located
        self.context.update({"turns_rewritten": encoded.turns_rewritten, "extra_sequences": len(encoded.earlier),
                             "repeated_tokens": encoded.repeated_tokens,
                             "turns_out_of_context": encoded.turns_out_of_context})

    def context_counts(self) -> dict[str, int]:
        """The manifest's and stats' counts of what the turn-context policy cost."""
        return {name: int(self.context.get(name, 0)) for name in CONTEXT_COUNTS}

    def cut_counts(self) -> dict[str, int]:
        """The manifest's and stats' counts of what --max-len cost."""
        return {name: int(self.cut.get(name, 0)) for name in CUT_COUNTS}

    def formats_seen(self, number: int, fallback: str) -> str:
        """The format of input ``number``'s records, "sharegpt+openai" for a file that mixes them."""
        seen = self.formats.get(number)
        return "+".join(fmt for fmt, _ in seen.most_common()) if seen else fallback

    def reject(self, record: Record, number: int, reason: str, code: str) -> None:
        if self.on_error == "fail":
            raise RecordFailure(record, reason)
        self.status[number] = REJECTED
        self.reasons[code] += 1
        self.entries.append({
            "file": record.file,
            "index": record.index,
            "line": record.line,
            "source_index": number,
            "reason": reason,
            "code": code,
            "record": _preview(record),
        })

    def write(self, entry: dict) -> None:
        """Write one numbered rejection to rejects.jsonl (the driver's ledger); keep the first of each reason.
        Its reason names settings as the caller spells them: ``--max-len`` from the CLI, ``max_len`` from
        Python (errors.spell; a worker process cannot tell who called, the driver can)."""
        entry["reason"] = spell(entry["reason"])
        self.examples.setdefault(entry["code"], entry)
        if self._handle is not None:
            self._handle.write(json.dumps(entry, ensure_ascii=False) + "\n")


def top_reasons(reasons: Counter, examples: dict[str, dict], top: int = 5, names_only: bool = False) -> list[str]:
    """The most common rejection reasons, each with its first example: file, line and the reason
    (``names_only``: the file's name without its folder, for what may be published: the manifest);
    past ``top``, one line naming the rest with their counts ("+N more"), so no reason goes unsaid."""
    lines = []
    ranked = reasons.most_common()
    for code, count in ranked[:top]:
        entry = examples.get(code)
        where = ""
        if entry is not None:
            at = f"line {entry['line']}" if entry["line"] else f"record {entry['index']}"
            file = os.path.basename(entry["file"]) if names_only else entry["file"]
            where = f": e.g. {file}, {at}: {entry['reason']}"
        lines.append(f"{code} {count:,}{where}")
    if len(ranked) > top:
        lines.append(f"+{len(ranked) - top:,} more reasons: {listing(f'{code} {count:,}' for code, count in ranked[top:])}")
    return lines


def _preview(record: Record) -> str:
    """The first 200 characters of the record as it was: raw text if it did not decode, else JSON."""
    if record.error is not None:
        return (record.data or "")[:200]
    return json.dumps(record.data, ensure_ascii=False, default=str)[:200]
