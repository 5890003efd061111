"""Tests of builder/: engine build, the engine directory, the memory plan and parity with transformers."""
