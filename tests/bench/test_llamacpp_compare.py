"""benchmarks/llamacpp_compare.py's report: llama-bench paired with the target alone prompt by prompt."""

from __future__ import annotations

import pytest

MACHINE = {"cpu_flags": ["avx2"], "threads": 2}


@pytest.fixture(scope="module")
def compare(benchmark_script):
    return benchmark_script("llamacpp_compare")


def run(row: str, prompt: str, temperature: float, tok_s: float, dataset: str = "humaneval") -> dict:
    return {
        "row": row,
        "dataset": dataset,
        "prompt": prompt,
        "temperature": temperature,
        "seed": 0,
        "K": 0,
        "tok_s": tok_s,
        "accepted_per_step": None,
        "drafted_per_step": None,
        **MACHINE,
    }


def section(text: str, title: str) -> list[str]:
    """The table rows under ``## title``."""
    lines = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    return [line for line in lines if line.startswith("| ") and not line.startswith("| T ")]


def test_each_prompts_target_alone_is_divided_by_its_own_llama_bench(compare, capsys):
    # greedy: the target alone runs at 0.9x, 1.0x and 0.8x of the llama-bench next to it; were they paired across
    # prompts, or medians divided, the figure would differ (the medians are 33 and 36: 0.917x)
    records = [
        run("llamacpp-alone", "a", 0.0, 27.0),
        run("llama-bench", "a", 0.0, 30.0),
        run("llamacpp-alone", "b", 0.0, 40.0),
        run("llama-bench", "b", 0.0, 40.0),
        run("llamacpp-alone", "c", 0.0, 33.0),
        run("llama-bench", "c", 0.0, 41.25),
        run("llamacpp-alone", "a", 1.0, 30.0),
        run("llama-bench", "a", 1.0, 30.0),
    ]
    compare.report(records)
    out = capsys.readouterr().out
    assert "## target alone against llama-bench\n" not in out  # no figures from before and after the runs
    rows = section(out, "target alone against llama-bench, prompt by prompt")
    assert rows[0].startswith("| 0 | 3 | 40.00 | 33.00 | 0.900x [")
    assert rows[1] == "| 1 | 1 | 30.00 | 30.00 | 1.000x |"
    speed = section(out, "speed against llama.cpp's target alone")
    assert [line.split(" | ")[2] for line in speed] == ["llamacpp-alone", "llamacpp-alone"]  # llama-bench is not a row


def test_every_row_is_divided_by_the_llama_bench_beside_it_per_dataset(compare, capsys):
    # lookup at 1.1x and 0.9x of llama-bench on two humaneval prompts (the target alone 0.9x and 1.0x), and 2.0x on a
    # pydoc-qa one: per dataset, each run over the llama-bench run of its own prompt
    records = [
        run("llamacpp-alone", "a", 0.0, 27.0),
        run("llama-bench", "a", 0.0, 30.0),
        run("llamacpp-lookup", "a", 0.0, 33.0),
        run("llamacpp-alone", "b", 0.0, 40.0),
        run("llama-bench", "b", 0.0, 40.0),
        run("llamacpp-lookup", "b", 0.0, 36.0),
        run("llamacpp-alone", "q", 0.0, 20.0, "pydoc-qa"),
        run("llama-bench", "q", 0.0, 25.0, "pydoc-qa"),
        run("llamacpp-lookup", "q", 0.0, 50.0, "pydoc-qa"),
    ]
    compare.report(records)
    rows = section(capsys.readouterr().out, "every row against llama-bench, per dataset")
    assert rows == [
        "| 0 | humaneval | llamacpp-alone | 2 | 33.50 | 0.950x | 1.000x |",
        "| 0 | humaneval | llamacpp-lookup | 2 | 34.50 | 1.000x | 1.061x |",
        "| 0 | pydoc-qa | llamacpp-alone | 1 | 20.00 | 0.800x | 1.000x |",
        "| 0 | pydoc-qa | llamacpp-lookup | 1 | 50.00 | 2.000x | 2.500x |",
    ]


def test_without_llama_bench_every_row_is_divided_by_the_target_alone_per_dataset(compare, capsys):
    # lookup at 1.2x and 0.9x of the target alone on two humaneval prompts and 2.0x on a pydoc-qa one; paired across
    # prompts, or medians divided, humaneval's figure would differ (medians 35 and 33: 1.061x)
    records = [
        run("llamacpp-alone", "a", 1.0, 30.0),
        run("llamacpp-lookup", "a", 1.0, 36.0),
        run("llamacpp-alone", "b", 1.0, 40.0),
        run("llamacpp-lookup", "b", 1.0, 36.0),
        run("llamacpp-alone", "q", 1.0, 20.0, "pydoc-qa"),
        dict(run("llamacpp-lookup", "q", 1.0, 40.0, "pydoc-qa"), accepted_per_step=1.5, drafted_per_step=2.0),
    ]
    compare.report(records)
    out = capsys.readouterr().out
    assert "## every row against llama-bench, per dataset" not in out
    rows = section(out, "every row against the target alone, per dataset")
    assert rows == [
        "| 1 | humaneval | llamacpp-alone | 2 | 35.00 | 1.000x | - | - |",
        "| 1 | humaneval | llamacpp-lookup | 2 | 36.00 | 1.050x | - | - |",
        "| 1 | pydoc-qa | llamacpp-alone | 1 | 20.00 | 1.000x | - | - |",
        "| 1 | pydoc-qa | llamacpp-lookup | 1 | 40.00 | 2.000x | 1.50 | 2.00 |",
    ]
    assert "## block against token verification" not in out  # no block rows: no empty table


def test_every_row_is_divided_by_llama_cpps_own_generation_beside_it_per_dataset(compare, capsys):
    # llama.cpp's own generation samples, llama-bench does not: each is a table of its own, every row over that run on
    # its own prompt (the default at 1.1x and 1.0x of llama-completion on two prompts, 0.95x and 0.85x of llama-bench)
    records = [
        run("llamacpp-alone", "a", 1.0, 27.0),
        run("llama-bench", "a", 1.0, 40.0),
        run("llama.cpp-alone", "a", 1.0, 34.545),
        run("llamacpp-default", "a", 1.0, 38.0),
        run("llamacpp-alone", "b", 1.0, 30.0),
        run("llama-bench", "b", 1.0, 40.0),
        run("llama.cpp-alone", "b", 1.0, 34.0),
        run("llamacpp-default", "b", 1.0, 34.0),
    ]
    compare.report(records)
    out = capsys.readouterr().out
    assert section(out, "every row against llama.cpp-alone, per dataset") == [
        "| 1 | humaneval | llamacpp-alone | 2 | 28.50 | 0.832x | 1.000x |",
        "| 1 | humaneval | llama-bench | 2 | 40.00 | 1.167x | 1.407x |",
        "| 1 | humaneval | llamacpp-default | 2 | 36.00 | 1.050x | 1.270x |",
    ]
    assert section(out, "every row against llama-bench, per dataset")[1:] == [
        "| 1 | humaneval | llama.cpp-alone | 2 | 34.27 | 0.857x | 1.206x |",
        "| 1 | humaneval | llamacpp-default | 2 | 36.00 | 0.900x | 1.270x |",
    ]
    speed = section(out, "speed against llama.cpp's target alone")
    assert [line.split(" | ")[2] for line in speed] == ["llamacpp-alone", "llama.cpp-alone", "llamacpp-default"]


def test_the_machine_line_names_the_llama_cpp_builds_the_records_hold(compare, capsys):
    records = [run("llamacpp-alone", "a", 0.0, 27.0), run("llama-bench", "a", 0.0, 30.0)]
    compare.report(records)
    assert capsys.readouterr().out.startswith("Machine: CPU flags avx2; 2 threads.\n")
    compare.report([dict(r, llamacpp_build="CPU : AVX2 = 1 |") for r in records])
    assert capsys.readouterr().out.startswith(
        "Machine: CPU flags avx2; 2 threads. llama.cpp built with: CPU : AVX2 = 1 |.\n"
    )


def test_block_without_llama_cpp_rows_is_compared_with_nothing(compare, capsys):
    """A run without llama.cpp's own speculative decoding has no figure of its to divide by: "-", not nan."""
    block = dict(
        run("llamacpp-block-q4", "a", 1.0, 11.0), expected_token=2.0, expected_block=2.1, accepted_per_step=2.2
    )
    compare.report([run("llamacpp-alone", "a", 1.0, 10.0), block])
    rows = section(capsys.readouterr().out, "block against token verification, and against llama.cpp's own rule")
    assert rows == ["| 1 | llamacpp-block-q4 | 1 | 2.000 | 2.100 | +5.0% | 2.20 | - | - |"]
    spec = dict(run("llama.cpp-spec", "a", 1.0, 8.0), accepted_per_step=2.0)
    compare.report([run("llamacpp-alone", "a", 1.0, 10.0), block, spec])
    rows = section(capsys.readouterr().out, "block against token verification, and against llama.cpp's own rule")
    assert rows == ["| 1 | llamacpp-block-q4 | 1 | 2.000 | 2.100 | +5.0% | 2.20 | 2.00 | 1.10x |"]


AVX512_INFO = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 |"
AVX512_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"


def tools(folder, flags: str, programs=None):
    """A folder of llama.cpp's programs (empty files) and the flags they were built with."""
    (folder / "cmake-args").write_text(flags + "\n")
    for name in programs or ("llama-bench", "llama-completion", "llama-speculative-simple"):
        (folder / name).touch()
    return folder


def test_tools_built_with_the_same_instruction_sets_are_taken(compare, tmp_path):
    assert compare.tools_flags(tools(tmp_path, AVX512_ARGS), AVX512_INFO) == AVX512_ARGS


def test_tools_built_before_llama_completion_was_among_them_are_refused_naming_it(compare, tmp_path):
    folder = tools(tmp_path, AVX512_ARGS, ("llama-bench", "llama-speculative-simple"))
    with pytest.raises(SystemExit, match="lacks llama-completion: build the tools"):
        compare.tools_flags(folder, AVX512_INFO)


@pytest.mark.parametrize(
    ("flags", "system_info", "named"),
    [
        # tools built with AVX2 only (another machine kind, or CMAKE_ARGS="-DGGML_NATIVE=OFF") beside an AVX-512 build
        ("-DGGML_NATIVE=OFF", AVX512_INFO, "AVX512_BF16"),
        # AVX-512 tools beside a blockspec llama.cpp built for AVX2
        (AVX512_ARGS, "CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 |", "AVX512"),
        # one extension apart
        (AVX512_ARGS.replace(" -DGGML_AVX512_BF16=ON", ""), AVX512_INFO, "AVX512_BF16"),
    ],
)
def test_tools_built_with_other_instruction_sets_are_refused(compare, tmp_path, flags, system_info, named):
    with pytest.raises(SystemExit, match=named):
        compare.tools_flags(tools(tmp_path, flags), system_info)


def test_tools_without_recorded_flags_are_refused(compare, tmp_path):
    with pytest.raises(SystemExit, match="cmake-args is missing"):
        compare.tools_flags(tmp_path, AVX512_INFO)


# the end of llama-completion's log (llama.cpp as vendored in llama-cpp-python 0.3.36), 32 tokens greedy
COMPLETION_LOG = """\
0.01.986.797 I generate: n_ctx = 4096, n_batch = 2048, n_predict = 32, n_keep = 0
0.07.509.171 I common_perf_print:    sampling time =      59.90 ms
0.07.509.227 I common_perf_print:    samplers time =      51.55 ms /   184 tokens
0.07.509.278 I common_perf_print:        load time =    1381.85 ms
0.07.509.327 I common_perf_print: prompt eval time =    3357.12 ms /   152 tokens (   22.09 ms per token,    45.28 tokens per second)
0.07.509.394 I common_perf_print:        eval time =    2101.45 ms /    31 runs   (   67.79 ms per token,    14.75 tokens per second)
0.07.509.443 I common_perf_print:       total time =    5523.21 ms /   183 tokens
"""  # noqa: E501 (its lines as llama.cpp writes them)


def fake_completion(folder, log: str):
    """A llama-completion that writes ``log`` to stderr and its arguments to ``folder / "args"``."""
    program = folder / "llama-completion"
    program.write_text(f'#!/bin/sh\necho "$@" > {folder / "args"}\ncat >&2 <<"LOG"\n{log}LOG\n')
    program.chmod(0o755)


def test_llama_cpps_own_generation_is_timed_by_its_counters_sampling_included(compare, tmp_path):
    fake_completion(tmp_path, COMPLETION_LOG)
    args = type("Args", (), {"max_new_tokens": 32})
    measured = compare.llama_completion(tmp_path, tmp_path / "target.gguf", "<|im_start|>hi", args, 1.0, 7)
    # 31 tokens evaluated after they were sampled, and the last one: over 2101.45 ms of evaluation and 59.90 of
    # sampling (not the prompt's 3357.12 ms, nor the samplers' count of 184, which includes the prompt's tokens)
    assert measured["tokens"] == 32
    assert measured["tok_s"] == pytest.approx(32 / 2.16135, rel=1e-9)
    assert (measured["eval_s"], measured["sampling_s"]) == pytest.approx((2.10145, 0.0599), rel=1e-9)
    passed = (tmp_path / "args").read_text().split()
    for flag, value in (("--temp", "1.0"), ("--top-k", "0"), ("--top-p", "1"), ("--min-p", "0"), ("--seed", "7")):
        assert passed[passed.index(flag) + 1] == value  # the plain law, as llama.cpp-spec's target samples it
    assert "-no-cnv" in passed  # the chat-formatted prompt as it is, no template of llama.cpp's around it


def test_llama_cpps_own_generation_without_its_counters_is_an_error_not_a_figure(compare, tmp_path):
    fake_completion(tmp_path, COMPLETION_LOG.replace("sampling time", "sampler time"))
    args = type("Args", (), {"max_new_tokens": 32})
    with pytest.raises(RuntimeError, match="unexpected llama-completion output"):
        compare.llama_completion(tmp_path, tmp_path / "target.gguf", "hi", args, 0.0, 0)
