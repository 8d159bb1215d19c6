"""The tokenizer of a GGUF file that is no preset's (``convert.gguf_tokenizer``): transformers reads it from the
header (about 15 s for a 151,936-token vocabulary), once; later loads read its copy in the cache, named after the
sha256 of the file's metadata (``integrity.metadata_sha256``), so no load takes a tokenizer from another file's."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from pathlib import Path

import gguf
import pytest
from kits.tiny import tiny_model
from kits.tinygguf import damage_gguf, header_reads, save_gguf, tokenizer_gguf

from blockspec.models import convert, integrity
from blockspec.models.cache import header_copy_dir
from blockspec.models.presets import ChecksumMismatchError

TEXT = "ab cab ba"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny model as llama.cpp runs it (its tokenizer, with a merge that never fires, is not one transformers
    reads)."""
    return Path(save_gguf(tiny_model(), tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture
def tokens_gguf(tmp_path) -> Path:
    return tokenizer_gguf(tmp_path / "files" / "tok.gguf")


def metadata_end(path: Path) -> int:
    """Where gguf's own reader finds the metadata's last value ending."""
    last = list(gguf.GGUFReader(path).fields.values())[-1]
    return last.offset + sum(int(part.nbytes) for part in last.parts)


def copy_with(source: Path, target: Path, edit) -> Path:
    """``source`` copied to ``target`` with its bytes passed through ``edit``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(edit(source.read_bytes()))
    return target


def eos_renamed(data: bytes) -> bytes:
    """The tiny model's EOS token renamed at the same length, in the metadata's token list and merge."""
    assert data.count(b"<eos>") == 3
    return data.replace(b"<eos>", b"<eot>")


def kept_copy(path: Path) -> Path:
    import transformers

    metadata = integrity.metadata_sha256(path)
    assert metadata is not None
    return header_copy_dir(path, metadata, transformers.__version__)


# --- the metadata's hash ------------------------------------------------------------------------------------------


def test_the_metadata_hash_covers_the_metadata_and_nothing_after_it(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    end = metadata_end(tiny_gguf)
    assert integrity.metadata_sha256(tiny_gguf) == hashlib.sha256(data[:end]).hexdigest()
    tensors_changed = copy_with(tiny_gguf, tmp_path / "a.gguf", lambda d: d[:-1] + bytes([d[-1] ^ 1]))
    assert integrity.metadata_sha256(tensors_changed) == integrity.metadata_sha256(tiny_gguf)
    tokenizer_changed = copy_with(tiny_gguf, tmp_path / "b.gguf", eos_renamed)
    assert integrity.metadata_sha256(tokenizer_changed) != integrity.metadata_sha256(tiny_gguf)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: b"not a GGUF file at all, only text " * 4,
        lambda d: d[:4] + (1).to_bytes(4, "little") + d[8:],  # version 1: 32-bit counts, unknown here
        lambda d: d[:20],  # shorter than the header
        lambda d: d[:16] + (1 << 40).to_bytes(8, "little") + d[24:],  # more metadata than the file holds
        lambda d: d[:300],  # cut inside the metadata
        None,  # cut one byte before the metadata's end
        lambda d: d[:16] + (1 << 63).to_bytes(8, "little") + d[24:],  # 2**63 keys
    ],
    ids=["text", "version 1", "20 bytes", "metadata count", "cut in the metadata", "one byte short", "2**63 keys"],
)
def test_no_metadata_hash_for_what_is_not_a_whole_gguf_header(tiny_gguf, tmp_path, edit):
    end = metadata_end(tiny_gguf)
    assert 300 < end
    edit = edit or (lambda d: d[: end - 1])
    assert integrity.metadata_sha256(copy_with(tiny_gguf, tmp_path / "bad.gguf", edit)) is None


def test_no_metadata_hash_for_lengths_past_any_file(tmp_path):
    """A string of 2**63 bytes, an array of 2**62 strings, arrays nested past Python's recursion limit: None, fast,
    not an overflow or a recursion error."""
    head = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    key = (1).to_bytes(8, "little") + b"k"
    string = (8).to_bytes(4, "little") + (1 << 63).to_bytes(8, "little")
    strings = (9).to_bytes(4, "little") + (8).to_bytes(4, "little") + (1 << 62).to_bytes(8, "little")
    nested = (9).to_bytes(4, "little") + ((9).to_bytes(4, "little") + (1).to_bytes(8, "little")) * 5000
    for n, value in enumerate((string, strings + bytes(64), nested)):
        path = tmp_path / f"{n}.gguf"
        path.write_bytes(head + key + value)
        assert integrity.metadata_sha256(path) is None


# --- the kept tokenizer -------------------------------------------------------------------------------------------


def test_the_tokenizer_is_read_from_the_header_once_then_from_its_copy(tokens_gguf, cache, monkeypatch):
    reads = header_reads(monkeypatch)
    first = convert.gguf_tokenizer(tokens_gguf)
    again = convert.gguf_tokenizer(tokens_gguf)
    assert reads == ["tok.gguf"]
    out = kept_copy(tokens_gguf)
    assert out.parent == cache / "tokenizers"
    marker = json.loads((out / "blockspec-preset.json").read_text())
    assert marker["gguf_metadata_sha256"] == integrity.metadata_sha256(tokens_gguf)
    assert "tokenizer.json" in marker["files"]
    read = convert.header_tokenizer(tokens_gguf)
    assert first(TEXT).input_ids == again(TEXT).input_ids == read(TEXT).input_ids
    assert again.get_vocab() == read.get_vocab() and again.eos_token == read.eos_token == "<eos>"


def test_a_moved_file_keeps_its_copy_and_another_tokenizer_gets_its_own(tokens_gguf, cache, monkeypatch, tmp_path):
    """The copy belongs to the metadata, not the path: the same file elsewhere reads no header, and a file of the
    same name whose tokenizer differs (its EOS renamed) gets its own tokenizer, not the first file's."""
    reads = header_reads(monkeypatch)
    convert.gguf_tokenizer(tokens_gguf)
    moved = copy_with(tokens_gguf, tmp_path / "elsewhere" / "tok.gguf", lambda d: d)
    assert convert.gguf_tokenizer(moved).eos_token == "<eos>" and reads == ["tok.gguf"]
    other = tokenizer_gguf(tmp_path / "other" / "tok.gguf", eos="<eot>")
    assert convert.gguf_tokenizer(other).eos_token == "<eot>" and reads == ["tok.gguf", "tok.gguf"]
    assert convert.gguf_tokenizer(other).eos_token == "<eot>" and convert.gguf_tokenizer(moved).eos_token == "<eos>"
    assert len(reads) == 2 and len(list((cache / "tokenizers").iterdir())) == 2


def test_a_copy_read_by_another_transformers_version_is_made_again(tokens_gguf, cache, monkeypatch):
    import transformers

    reads = header_reads(monkeypatch)
    convert.gguf_tokenizer(tokens_gguf)
    first = kept_copy(tokens_gguf)
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    convert.gguf_tokenizer(tokens_gguf)
    convert.gguf_tokenizer(tokens_gguf)
    assert reads == ["tok.gguf", "tok.gguf"]
    out = kept_copy(tokens_gguf)
    assert out != first and first.is_dir()  # an environment sharing the cache keeps its own copy
    assert json.loads((out / "blockspec-preset.json").read_text())["transformers"] == "0.0.1"


def test_a_file_rewritten_while_its_tokenizer_is_read_keeps_no_copy(tokens_gguf, cache, monkeypatch, tmp_path):
    """What was read may be the old file's tokenizer or the new one's: neither is kept under the hash taken before."""
    from transformers import AutoTokenizer

    load = AutoTokenizer.from_pretrained

    def rewritten_meanwhile(folder, *args, **kwargs):
        tokenizer = load(folder, *args, **kwargs)
        if "gguf_file" in kwargs:
            tokenizer_gguf(tokens_gguf, eos="<eot>")
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", rewritten_meanwhile)
    with pytest.raises(ValueError, match="tok.gguf changed while its tokenizer was read; load it again"):
        convert.gguf_tokenizer(tokens_gguf)
    assert list((cache / "tokenizers").iterdir()) == []


def test_a_changed_copy_is_refused_not_loaded(tokens_gguf, cache):
    convert.gguf_tokenizer(tokens_gguf)
    out = kept_copy(tokens_gguf)
    with open(out / "tokenizer.json", "r+b") as f:
        f.seek(40)
        byte = f.read(1)[0]
        f.seek(40)
        f.write(bytes([byte ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=rf"tok.gguf: .*tokenizer.json.*delete {re.escape(str(out))}"):
        convert.gguf_tokenizer(tokens_gguf)
    shutil.rmtree(out)
    assert convert.gguf_tokenizer(tokens_gguf).eos_token == "<eos>"


def test_a_cache_that_cannot_take_the_tokenizer_still_gives_it(tokens_gguf, cache, monkeypatch, caplog):
    from transformers import PreTrainedTokenizerBase

    reads = header_reads(monkeypatch)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    for _ in range(2):
        assert convert.gguf_tokenizer(tokens_gguf)(TEXT).input_ids
    assert reads == ["tok.gguf", "tok.gguf"] and "cannot keep the tokenizer" in caplog.text
    assert list((cache / "tokenizers").iterdir()) == []


def test_a_damaged_file_is_a_clear_error_and_keeps_no_copy(tokens_gguf, cache, tmp_path):
    """A file whose metadata this reader cannot parse is left to transformers' reader, which fails on it as it did
    before any copy existed; the load names the file."""
    pytest.importorskip("llama_cpp")
    from blockspec.models.load import load_model

    damaged = damage_gguf(tokens_gguf, tmp_path / "damaged.gguf", "metadata count")
    assert integrity.metadata_sha256(damaged) is None
    with pytest.raises(ValueError, match="damaged.gguf: not a valid GGUF file"):
        load_model(damaged, backend="llamacpp")
    assert not (cache / "tokenizers").exists()


@pytest.mark.parametrize("backend", ["llamacpp", "hf"])
def test_loading_a_gguf_file_takes_its_kept_tokenizer(tiny_gguf, cache, monkeypatch, backend):
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
    from kits.tiny import tiny_tokenizer

    from blockspec.models.load import load_model

    calls = []
    monkeypatch.setattr(convert, "gguf_tokenizer", lambda path: calls.append(path) or tiny_tokenizer())
    model = load_model(str(tiny_gguf), backend=backend)
    assert calls == [tiny_gguf] and model.tokenizer is not None and model.tokenizer.eos_token == "<eos>"
