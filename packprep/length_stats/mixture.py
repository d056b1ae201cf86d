"""stats, mixture: what ``pack --mix ... --validation-size ...`` would train on, per source, and the what-if
table of that training split at each ``--max-len``.

A share is a fraction of the tokens after ``--overlong`` at the row length, so each ``--max-len`` gets
its own selection, drawn as ``pack`` draws it (:func:`packprep.mix.plan_by_record`, same seed); the
what-if rows of a length are planned on that length's training sequences, copies included (the
validation split is left out). The per-source table is the selection at the longest ``--max-len``.
"""

from __future__ import annotations

import numpy as np

from ..fates import DROPPED, EMPTIED, REJECTED
from ..mix import Mixture, plan_by_record
from ..plan import overlong_fates
from .whatif import what_if


def mixture_what_if(mixture: Mixture, collected, tally, sources, max_lens: list[int], strategies: list[str],
                    *, overlong: str, seed: int, **plan) -> tuple[dict, list[dict]]:
    """(the per-source table, the what-if rows) of ``collected`` (stats' lengths of the accepted
    conversations, ``tally`` their ledger) under ``mixture``."""
    accepted = np.flatnonzero(np.frombuffer(tally.status, np.uint8) != REJECTED)  # each conversation's record
    records = np.repeat(accepted, collected.sequences)  # each sequence's (turn_context exact: several a record)
    group_of = mixture.group_of(records, [source.records for source in sources])
    lengths, rows = collected.lengths, []
    for max_len in sorted(max_lens):
        fates = overlong_fates(lengths, max_len, overlong, collected.within[max_len])
        kept = np.flatnonzero((fates != DROPPED) & (fates != EMPTIED))
        clipped = np.minimum(lengths, max_len) if overlong == "truncate" else lengths
        selection = plan_by_record(mixture.sources, records[kept], group_of[kept], clipped[kept], seed,
                                   mixture.validation_size)
        train = kept[selection.train]
        rows += what_if(lengths[train], collected.supervised[train], [max_len], strategies,
                        supervised_within={max_len: collected.within[max_len][train]},
                        split_masked={max_len: collected.masked[max_len][train]}, overlong=overlong, seed=seed,
                        **plan)
    table = _table(mixture, records, group_of, lengths, kept, clipped, selection)  # the last: at the longest max_len
    return {"max_len": max(max_lens), "validation_size": mixture.validation_size, "sources": table}, rows


def _table(mixture: Mixture, records, group_of, lengths, kept, clipped, selection) -> list[dict]:
    copies = selection.copies(len(kept))
    held = np.zeros(len(kept), bool)
    held[selection.validation] = True
    groups = group_of[kept]
    tokens = np.bincount(groups, copies * clipped[kept], minlength=len(mixture.sources))
    total = max(1, int(tokens.sum()))
    table = []
    for number, source in enumerate(mixture.sources):
        mine = group_of == number
        table.append({**source.describe(), "conversations": len(np.unique(records[mine])),
                      "tokens": int(lengths[mine].sum()),
                      "validation_records": len(np.unique(records[kept][held & (groups == number)])),
                      "train_sequences": int(copies[groups == number].sum()),
                      "train_tokens": int(tokens[number]), "realized_share": round(int(tokens[number]) / total, 6)})
    return table
