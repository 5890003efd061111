"""Benchmarks (each module a script: run it as `python -m bench.NAME` from the repository root) and the lab
notebook, NOTES.md. The scripts print tables and write bench/results/NAME.json; anchors/ holds the anchor
measurements their methodology follows. Nothing in the engine imports this package."""
