"""The ``packprep`` program: ``python -m packprep``, and the console script."""

import sys

from .interrupts import sigterm_interrupts


def run() -> None:
    sigterm_interrupts()  # a stop while the libraries load is an interruption too (exit 130), not a SIGTERM death
    try:
        from .cli import main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; no output was written\n")
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
