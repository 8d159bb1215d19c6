"""Tests of blockspec inside vLLM; they run in vLLM's own environment (scripts/setup_vllm.sh), not the main one."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # vllmkit here, the main suite's kits (tests/kits)
