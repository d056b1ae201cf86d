"""What becomes of an input record, in one vocabulary: the ledger's (``packprep.ledger.Ledger``, one
byte a record; the manifest counts them and ``verify`` checks they add up) and the ``--overlong``
rule's (:func:`packprep.plan.overlong_fates`, decided for a sample from its length, before packing).

A record is packed whole, truncated, split into pieces, or rejected with a reason. The ``--overlong``
rule decides, in the same words: ``PACKED`` (it fits, or ``split`` leaves it to the planner, which
may cut it: its record becomes ``SPLIT``), ``TRUNCATED`` (cut to ``--max-len``: its record's fate
too), or one of two rejections, whose record becomes ``REJECTED`` with the reason ``overlong``:
``DROPPED`` (``--overlong drop``) and ``EMPTIED`` (no trained token left after truncation).
"""

FATES = ("packed", "truncated", "split", "rejected")  # a record's fate, by its code: the manifest's counts
PACKED, TRUNCATED, SPLIT, REJECTED = range(len(FATES))
DROPPED, EMPTIED = len(FATES), len(FATES) + 1  # the --overlong rule's rejections (their records: REJECTED)
UNSAMPLED = len(FATES) + 2  # a ledger status beside FATES: an accepted record a mixture left out (mix.py)
