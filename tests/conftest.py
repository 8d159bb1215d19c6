import sys
from pathlib import Path

# Make tests/lawkit.py importable as `lawkit` from every test module.
sys.path.insert(0, str(Path(__file__).parent))
