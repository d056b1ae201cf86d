import sys

try:  # a Ctrl-C while the libraries load is an interruption too, not a traceback
    from .cli import main
except KeyboardInterrupt:
    sys.stderr.write("interrupted; no output was written\n")
    sys.exit(130)

main()
