"""Exit 1, naming the differences, where the installed llama.cpp was not built with the instruction sets that the
CMake arguments in argv[1] ask for (scripts/setup.sh then compiles it again); exit 0 where they agree or
llama-cpp-python is not installed. A build with sets this CPU lacks may crash here, which exits non-zero too."""

import importlib.metadata
import sys

from blockspec.models.llamacpp import build_info, build_mismatches

try:
    importlib.metadata.version("llama-cpp-python")
except importlib.metadata.PackageNotFoundError:
    sys.exit(0)
mismatches = build_mismatches(sys.argv[1], build_info())
for mismatch in mismatches:
    print(f"installed llama.cpp: {mismatch}", file=sys.stderr)
sys.exit(1 if mismatches else 0)
