"""Writing the small files blockspec keeps (cache markers, probes, profiles) so that no reader ever sees half of one.

Standard library only: every layer may import it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TEMPORARY_SUFFIX = ".tmp"  # what a write in progress is named with: `<name>.<random>.tmp`, in the file's folder


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace the content of ``path`` with ``text``: written to a temporary file in the same folder (so the rename
    stays on one file system), flushed to disk, then renamed over ``path``. A concurrent reader sees the old file or
    the new one, and a crash leaves ``path`` as it was (plus, at worst, the temporary file)."""
    path = Path(path)
    # A random name rather than tempfile's: those are created readable by their owner alone, not as the umask says.
    temporary = path.with_name(f"{path.name}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")
    try:
        with open(temporary, "x") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())  # the data is on disk before the name points to it
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
