"""The benchmarks: programs that print a table and ratios against a baseline measured in the same run.

A package so each runs as `python3 -m bench.NAME` from the repository's root,
where `llmgwctl`, `bench` and `tests` (the fleet simulator, free ports) import
as they are in this tree, with no path edits. Not part of the wheel.
"""
from pathlib import Path

# The tree the benches are in: a bench starts its children here, since
# `python -m` puts the working directory first on sys.path, and a child
# started from another checkout would measure that checkout's code.
REPO = Path(__file__).resolve().parent.parent
