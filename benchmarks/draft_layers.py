"""Would a draft with fewer layers pay on llama.cpp? Acceptance of the bundled 0.5B draft (q4_0, as `generate` runs
it on llama.cpp) with some of its 24 layers dropped, against the 1.5B target.

A draft's law is its own whatever its layers, and verification sees it, so a cut draft stays lossless; the question
is only whether the cheaper forward buys more than the acceptance it loses. The layers dropped are the last ones
before the final layer (the first layers build the features every later one reads; the final one maps them to the
output layer's space). Per kept count, blockspec decodes each prompt with block verification at K = 3 and records
the acceptance length (tokens per target forward) and the share of the draft's bytes per token that its layers are
(what a drafted token reads: every layer, and the output layer; the embedding reads one row).

    python benchmarks/draft_layers.py run --out results/draft-layers
    python benchmarks/draft_layers.py report --out results/draft-layers   # records.jsonl, or records.jsonl.gz

No timing: the records are acceptance and byte counts, so the run may share the machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from pathlib import Path

KEPT = (24, 22, 20, 16)  # layers kept of the draft's 24


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="measure, writing <out>/records.jsonl")
    run_parser.add_argument("--datasets", nargs="+", default=["humaneval", "pydoc-qa", "sharegpt"])
    run_parser.add_argument("--prompts", type=int, default=2, help="per dataset")
    run_parser.add_argument("--max-new-tokens", type=int, default=64)
    run_parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    for each in (run_parser, sub.add_parser("report", help="print the table of <out>/records.jsonl(.gz)")):
        each.add_argument("--out", type=Path, default=Path("results/draft-layers"))
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    path = args.out / "records.jsonl.gz"
    text = gzip.open(path, "rt").read() if path.is_file() else (args.out / "records.jsonl").read_text()
    report([json.loads(line) for line in text.splitlines()])
    return 0


def drop_layers(source: Path, out: Path, kept: int) -> dict:
    """``source`` with its layers ``kept - 1`` .. ``n - 2`` dropped (the final layer stays), renumbered, written to
    ``out``; returns the bytes a drafted token reads in its layers and in its output layer."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    keep = [*range(kept - 1), layers - 1]
    new = {old: i for i, old in enumerate(keep)}
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = kept if key == f"{arch}.block_count" else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    read = {"layers": 0, "output": 0}
    for tensor in reader.tensors:
        name, layer = tensor.name, re.match(r"blk\.(\d+)\.(.*)", tensor.name)
        if layer:
            if int(layer[1]) not in new:
                continue
            name = f"blk.{new[int(layer[1])]}.{layer[2]}"
            read["layers"] += int(tensor.n_bytes)
        elif name == "output.weight":
            read["output"] += int(tensor.n_bytes)
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read


def run(args) -> None:
    from blockspec import SamplingParams, SpeculativeDecoder
    from blockspec.bench import datasets
    from blockspec.machine import cpu_flags
    from blockspec.models.chat import encode_prompt
    from blockspec.models.llamacpp import LlamaCppModel, load_llamacpp

    target = load_llamacpp("qwen2.5-coder-1.5b")
    full = load_llamacpp("qwen2.5-coder-0.5b", quant="q4_0")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = [(name, p) for name in args.datasets for p in datasets.load(name, n=args.prompts, seed=0)]
    with (args.out / "records.jsonl").open("w") as records:
        for kept in KEPT:
            path = args.out / f"draft-{kept}.gguf"
            read = drop_layers(full.path, path, kept)
            draft = LlamaCppModel(path, target.tokenizer, eos_token_ids=full.eos_token_ids)
            decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=3)
            for temperature in args.temperatures:
                for dataset, prompt in prompts:
                    ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
                    result = decoder.generate(
                        [ids], max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature), seed=0
                    )
                    entry = {
                        "kept": kept,
                        "temperature": temperature,
                        "dataset": dataset,
                        "prompt": prompt.id,
                        "acceptance_length": result.block_efficiency,
                        **{f"{part}_bytes": n for part, n in read.items()},
                        "cpu_flags": cpu_flags(),
                        "threads": target.threads,
                    }
                    records.write(json.dumps(entry) + "\n")
                    print(json.dumps({k: v for k, v in entry.items() if k != "cpu_flags"}), flush=True)
            del decoder, draft
            path.unlink()


def report(records: list[dict]) -> None:
    flags = sorted({" ".join(r["cpu_flags"]) for r in records})
    print(f"Machine: CPU flags {'; '.join(flags)}; {records[0]['threads']} threads.\n")
    print("## acceptance with layers dropped\n")
    print("| T | layers kept | runs | acceptance length | x all 24 layers | bytes per drafted token, x 24 layers |")
    print("|---|---|---|---|---|---|")
    for temperature in sorted({r["temperature"] for r in records}):
        at = [r for r in records if r["temperature"] == temperature]
        full = [r for r in at if r["kept"] == max(KEPT)]
        base = statistics.fmean(r["acceptance_length"] for r in full)
        base_bytes = full[0]["layers_bytes"] + full[0]["output_bytes"]
        for kept in KEPT:
            these = [r for r in at if r["kept"] == kept]
            if not these:
                continue
            length = statistics.fmean(r["acceptance_length"] for r in these)
            read = (these[0]["layers_bytes"] + these[0]["output_bytes"]) / base_bytes
            print(f"| {temperature:g} | {kept} | {len(these)} | {length:.2f} | {length / base:.2f}x | {read:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
