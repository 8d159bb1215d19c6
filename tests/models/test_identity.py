"""A model's identity by content (``models.identity``) and what it costs to find: a few MiB per file, once per
process while the file is unchanged."""

from __future__ import annotations

import builtins

from blockspec.models import identity, integrity

MIB = 1 << 20


def counting_reads(monkeypatch) -> list[int]:
    """The sizes of the reads ``integrity`` makes from now on."""
    reads = []

    def open_counting(*args, **kwargs):
        file = builtins.open(*args, **kwargs)
        read = file.read

        def counted(n=-1):
            data = read(n)
            reads.append(len(data))
            return data

        file.read = counted
        return file

    monkeypatch.setattr(integrity, "open", open_counting, raising=False)
    return reads


def test_a_gguf_fingerprint_reads_its_first_mib_and_the_sample_not_a_header_length_read_from_its_magic(
    tmp_path, monkeypatch
):
    """A GGUF file opens with b"GGUF" and its version, which read as a safetensors header length made the
    fingerprint read 100 MiB before its 64 sampled MiB."""
    gguf = tmp_path / "model.gguf"
    with open(gguf, "wb") as f:
        f.write(b"GGUF" + (3).to_bytes(4, "little"))
        f.truncate(300 * MIB)  # sparse: no disk used
    reads = counting_reads(monkeypatch)
    integrity.fingerprint(gguf)
    assert sum(reads) <= 9 + 65 * MIB


def test_a_files_fingerprint_is_read_once_per_process_while_its_stat_is_unchanged(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    first = identity.fingerprint(str(folder))
    reads = counting_reads(monkeypatch)
    assert identity.fingerprint(str(folder)) == first and not reads
