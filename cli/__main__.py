"""`python -m engine.cli` runs the CLI, for environments where the console script is not on PATH."""
from .app import main

main()
