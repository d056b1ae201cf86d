"""Execution engines other than the local process pool (see ``packprep.engines.ray``)."""
