"""``blockspec sv profile`` and ``sv calibrate`` (``sv replay``: sv_replay.py), and the SV options of ``generate``.

Profiles live by default in ``sv_dir()`` (``sv/`` in the model cache: ~/.cache/blockspec/sv unless
``BLOCKSPEC_CACHE`` says otherwise), named after the models' identity, the backend that ran them and the draft's
quantization (and the sampling, for the calibration profile: ``policy.profiles``), so ``generate --policy sv``
finds the ones measured for its configuration. The three commands resolve ``--backend`` and ``--draft-quant`` as
``generate`` does (``Setup``). A saved profile is replaced only with ``--force``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..defaults import (
    BACKENDS,
    COMPANION,
    DRAFT,
    DRAFT_LIMIT,
    DTYPES,
    LLAMACPP_QUANTS,
    QUANTS,
    SV_BATCH_SIZES,
    SV_PREDICTOR,
    TARGET,
)
from ..policy.profiles import latency_path, profile_path, run_name, sampling_key, sv_dir  # stdlib only: no torch
from . import sv_replay
from .common import ALLOW_DOWNLOAD_HELP, BACKEND_HELP, DEVICE_HELP, int_at_least

COMPANION_HELP = (
    f"prefix:K (the target's first K layers) or a model sharing the target's tokenizer, on transformers only "
    f"(default: {COMPANION} on transformers, none on llama.cpp)"
)
FORCE_HELP = "replace the profile already saved at the output path (without it, an existing one is kept)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that name an SV configuration (shared by generate and sv calibrate)."""
    parser.add_argument("--companion", help=f"SV companion: {COMPANION_HELP}")
    parser.add_argument(
        "--sv-predictor",
        default=SV_PREDICTOR,
        choices=["companion", "draft"],
        help="SV's acceptance features: the draft's alone, or with the companion's (transformers only) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--sv-profile",
        type=Path,
        help=f"SV calibration profile (default: `blockspec sv calibrate`'s, under {sv_dir()})",
    )
    parser.add_argument(
        "--latency", type=Path, help=f"SV latency profile (default: `blockspec sv profile`'s, under {sv_dir()})"
    )


def add_parser(sub) -> None:
    sv = sub.add_parser(
        "sv",
        help="Speculative Verification: measure latency, calibrate the acceptance predictor",
        description="Speculative Verification (Kim et al., arXiv 2509.24328) verifies, per row and step, only the "
        "drafted tokens predicted to pay for their cost. It needs two profiles for your models and machine: "
        "`sv profile` (step latency) and `sv calibrate` (the acceptance predictor). See docs/guide/sv.md.",
    )
    sv_sub = sv.add_subparsers(required=True, metavar="SV_COMMAND")

    profile = sv_sub.add_parser(
        "profile",
        help="measure target, draft and companion step latency on this machine",
        description="Time the target, draft and companion forwards over a grid of batch sizes and tokens per row, "
        "and save the table.",
    )
    _model_arguments(profile)
    profile.add_argument("--companion", help=f"{COMPANION_HELP}; none: no companion")
    profile.add_argument(
        "--batch-sizes", type=int_at_least(1), nargs="+", default=list(SV_BATCH_SIZES), help="(default: %(default)s)"
    )
    profile.add_argument(
        "--tokens",
        type=int_at_least(1),
        nargs="+",
        default=[1, 2, 3, 5, 9],
        help="tokens per row (default: %(default)s)",
    )
    profile.add_argument(
        "--context", type=int_at_least(1), default=160, help="cached tokens per row while timing (default: %(default)s)"
    )
    profile.add_argument(
        "--repeats", type=int_at_least(1), default=3, help="timed forwards per cell, median kept (default: %(default)s)"
    )
    profile.add_argument("--out", type=Path, help=f"output JSON (default: under {sv_dir()})")
    profile.add_argument("--force", action="store_true", help=FORCE_HELP)
    profile.set_defaults(run=run_profile)

    calibrate = sv_sub.add_parser(
        "calibrate",
        help="record drafted positions and fit the acceptance predictors",
        description="Decode calibration prompts verifying every drafted token, record each position's features "
        "and exact gain, fit the predictors of both rules and report their held-out log-loss and Brier score.",
    )
    _model_arguments(calibrate)
    add_arguments(calibrate)
    calibrate.add_argument(
        "--dataset",
        default="sharegpt",
        help="calibration prompts, disjoint from your evaluation sets (default: %(default)s)",
    )
    calibrate.add_argument("--prompts", type=int_at_least(1), default=24, help="(default: %(default)s)")
    calibrate.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="(default: %(default)s)")
    calibrate.add_argument(
        "--max-draft",
        type=int_at_least(1, DRAFT_LIMIT),
        default=8,
        help="K drafted and recorded per step (default: %(default)s)",
    )
    calibrate.add_argument("--batch-size", type=int_at_least(1), default=4, help="(default: %(default)s)")
    calibrate.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    calibrate.add_argument("--top-k", type=int_at_least(0), default=0, help="(default: %(default)s)")
    calibrate.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    calibrate.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    calibrate.add_argument("--out", type=Path, help=f"profile JSON (default: under {sv_dir()})")
    calibrate.add_argument("--force", action="store_true", help=FORCE_HELP)
    calibrate.add_argument("--recording", type=Path, help="also save the recorded positions, for `sv replay`")
    calibrate.set_defaults(run=run_calibrate)

    sv_replay.add_parser(sv_sub)


def _model_arguments(parser) -> None:
    parser.add_argument("--target", default=TARGET, help="(default: %(default)s)")
    parser.add_argument("--draft", default=DRAFT, help="(default: %(default)s)")
    parser.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help=BACKEND_HELP)
    parser.add_argument(
        "--draft-quant",
        default="auto",
        choices=["auto", "none", *QUANTS, *LLAMACPP_QUANTS],
        help=f"the draft's quantization, as generate runs it: {', '.join(QUANTS)} on transformers, "
        f"{', '.join(LLAMACPP_QUANTS)} on llama.cpp; auto: {LLAMACPP_QUANTS[0]} on llama.cpp, none on transformers "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="on transformers; auto: the fastest on this machine, as generate and bench pick it (default: %(default)s)",
    )
    parser.add_argument("--device", default="cpu", help=f"{DEVICE_HELP} (default: %(default)s)")
    parser.add_argument("--allow-download", action="store_true", help=ALLOW_DOWNLOAD_HELP)


@dataclass(frozen=True)
class Setup:
    """What SV's profiles are made for and found by, resolved before any model loads, the same way by ``generate
    --policy sv``, ``sv profile`` and ``sv calibrate``: the models as typed, the backend that runs them, the draft's
    quantization, the companion."""

    target: str
    draft: str
    backend: str  # one of BACKENDS
    draft_quant: str  # "none", or one of QUANTS (transformers) or LLAMACPP_QUANTS (llama.cpp)
    companion: str | None  # None: none (always on llama.cpp)
    dtype: str  # transformers' dtype, auto resolved as generate resolves it; llama.cpp runs the GGUF's own types
    device: str

    @property
    def quant(self) -> str | None:
        """The draft's quantization as ``load_model`` takes it."""
        return None if self.draft_quant == "none" else self.draft_quant

    @property
    def names(self) -> tuple[str, str]:
        """(target, draft) as the profiles name them: with the backend, and the draft's quantization
        (``profiles.run_name``)."""
        return run_name(self.target, self.backend), run_name(self.draft, self.backend, self.quant)

    def command(self, subcommand: str, sampling: dict | None = None, out: Path | None = None) -> str:
        """The ``blockspec sv profile`` or ``sv calibrate`` command line that makes this configuration's profile
        (for the calibration profile, of ``sampling_key`` ``sampling``), saved at ``out`` or where it is looked for."""
        words = ["blockspec", "sv", subcommand, "--target", self.target, "--draft", self.draft]
        words += ["--backend", self.backend, "--draft-quant", self.draft_quant]
        if self.backend == "hf":  # llama.cpp runs neither a companion nor a dtype, and only on the CPU
            words += ["--companion", self.companion or "none"]
            if subcommand == "profile":
                words += ["--dtype", self.dtype, "--device", self.device]
        if sampling is not None:  # repr: the profile is specific to the exact values
            words += ["--temperature", repr(float(sampling["temperature"])), "--top-k", str(sampling["top_k"])]
            words += ["--top-p", repr(float(sampling["top_p"]))]
        if out is not None:
            words += ["--out", str(out)]
        return shlex.join(words)


def resolve_companion(companion: str | None, backend: str, predictor: str) -> str | None:
    """The companion SV's profiles are made with and found by, from ``--companion`` (None where not given): by default
    COMPANION on transformers; none on llama.cpp, which runs none (a ``prefix:K`` companion is the target's own
    transformers layers); ``none``: none. Refuses, before any model loads, a companion on llama.cpp and the
    companion predictor without one."""
    if backend == "llamacpp":
        if predictor == "companion":
            raise ValueError(
                "--sv-predictor companion runs a companion built from the target's transformers layers: on "
                "--backend llamacpp use --sv-predictor draft (the default), or pass --backend hf"
            )
        if companion not in (None, "none"):
            raise ValueError(
                f"--companion {companion} runs on transformers only: on --backend llamacpp SV predicts from the "
                "draft alone (leave --companion out), or pass --backend hf"
            )
        return None
    if companion == "none":
        if predictor == "companion":
            raise ValueError("--sv-predictor companion needs a companion: leave out --companion none")
        return None
    return companion or COMPANION


def _setup(args, predictor: str = SV_PREDICTOR) -> Setup:
    """``sv profile``'s and ``sv calibrate``'s Setup; a device torch cannot use is refused here, before any load."""
    from ..models.load import resolve_backend, resolve_device
    from .generate import draft_quant_on  # generate imports this module: imported when called

    device = resolve_device(args.device)
    backend = resolve_backend(args.backend, args.device, args.target, args.draft)
    dtype = args.dtype
    if dtype == "auto" and backend == "hf":  # what generate's and bench's --dtype auto pick: the profiles match them
        from ..auto import choose_arithmetic

        dtype = choose_arithmetic(device).dtype
    return Setup(
        target=args.target,
        draft=args.draft,
        backend=backend,
        draft_quant=draft_quant_on(backend, args.draft_quant, sv=True),
        companion=resolve_companion(args.companion, backend, predictor),
        dtype=dtype,
        device=args.device,
    )


def build_policy(config, target, sampling):
    """(SVPolicy, companion model or None) for ``blockspec generate --policy sv`` (``config``: its GenerateConfig,
    backend, draft quantization and companion resolved): the profiles saved for this Setup; a missing one is an
    error naming the exact command that makes it."""
    from ..models.companion import load_companion
    from ..policy import SVPolicy
    from ..policy.latency import dtype_name
    from ..policy.profiles import calibration_file, latency_file
    from ..verify import SAMPLED_RULES

    setup = Setup(
        config.target, config.draft, config.backend, config.draft_quant, config.companion, config.dtype, config.device
    )
    names, key = setup.names, sampling_key(sampling)
    profile = calibration_file(
        *names, setup.companion, key, config.sv_profile, command=setup.command("calibrate", key, config.sv_profile)
    )
    dtype, device = dtype_name(target.dtype), str(target.device)
    latency = latency_file(
        *names, setup.companion, dtype, device, config.latency, command=setup.command("profile", out=config.latency)
    )
    # SV's predictors hold one closed form per sampled rule; greedy (or no --rule) takes the policy's default rule,
    # which gives the same accepted tokens at temperature 0
    rule = {"rule": config.rule} if config.rule in SAMPLED_RULES else {}
    policy = SVPolicy.from_cache(
        target,
        None,
        sampling=sampling,
        **rule,
        max_draft=config.resolved_max_draft,
        kind=config.sv_predictor,
        companion=setup.companion,
        profile=profile,
        latency=latency,
        names=names,
    )
    companion_name = setup.companion if config.sv_predictor == "companion" else None  # the draft predictor runs none
    companion = (
        load_companion(
            companion_name, target, dtype=config.dtype, device=config.device, allow_download=config.allow_download
        )
        if companion_name
        else None
    )
    return policy, companion


def run_profile(args) -> int:
    from ..auto import measure_profile
    from ..models.load import load_model
    from ..policy.latency import dtype_name

    setup = _setup(args)
    if args.out:
        check_output(args.out, args.force)
    load = {"device": args.device, "allow_download": args.allow_download, "backend": setup.backend}
    target = load_model(args.target, dtype=setup.dtype, **load)
    # the default path names the dtype ("gguf" on llama.cpp) and the device the target loaded on ("cuda:0" for
    # cuda): known once the target is loaded
    out = args.out or latency_path(*setup.names, setup.companion, dtype_name(target.dtype), str(target.device))
    if not args.out:
        check_output(out, args.force)
    draft = load_model(args.draft, dtype=setup.dtype, quant=setup.quant, **load)
    companion = _companion(setup, target, args)
    profile = measure_profile(
        target,
        draft,
        companion,
        batch_sizes=tuple(args.batch_sizes),
        tokens=tuple(args.tokens),
        context=args.context,
        repeats=args.repeats,
    )
    # the names the other commands look the profile up by: what the user typed, with the backend and quantization
    target_name, draft_name = setup.names
    profile.meta.update(target=target_name, draft=draft_name, companion=setup.companion)
    profile.save(out)
    for name, table in (("target", profile.target), ("draft", profile.draft), ("companion", profile.companion)):
        if table is not None:
            print(
                f"{name} forward seconds (rows: batch {list(table.batch_sizes)}; columns: tokens per row "
                f"{list(table.tokens)})"
            )
            for batch, row in zip(table.batch_sizes, table.seconds):
                print(f"  B={batch:<3} " + " ".join(f"{s:8.3f}" for s in row))
    print(f"saved {out}")
    return 0


def _companion(setup: Setup, target, args):
    """The companion ``sv profile`` and ``sv calibrate`` measure with, or None."""
    from ..models.companion import load_companion

    if setup.companion is None:
        return None
    return load_companion(
        setup.companion, target, dtype=setup.dtype, device=args.device, allow_download=args.allow_download
    )


def run_calibrate(args) -> int:
    from ..bench.calibrate import Recorder, fit_profile, record
    from ..bench.datasets import load as load_prompts
    from ..engine import SpeculativeDecoder
    from ..models.chat import encode_prompt
    from ..models.load import load_model
    from ..sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)  # values checked before the models load
    setup = _setup(args, args.sv_predictor)
    target_name, draft_name = setup.names
    out = args.out or profile_path(target_name, draft_name, setup.companion, sampling_key(sampling))
    check_output(out, args.force)
    load = {"device": args.device, "allow_download": args.allow_download, "backend": setup.backend}
    target = load_model(args.target, dtype=setup.dtype, **load)
    draft = load_model(args.draft, dtype=setup.dtype, quant=setup.quant, **load)
    companion = _companion(setup, target, args)
    recorder = Recorder(args.max_draft, companion=companion is not None)
    decoder = SpeculativeDecoder(
        target, draft, rule="token", max_draft=args.max_draft, policy=recorder, companion=companion
    )
    prompts = load_prompts(args.dataset, args.prompts, seed=args.seed)
    ids = [encode_prompt(decoder.tokenizer, p.text, chat=True) for p in prompts]
    recording = record(
        decoder, ids, sampling=sampling, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed
    )
    if args.recording:
        recording.save(args.recording)
    profile, report = fit_profile(
        recording, target=target_name, draft=draft_name, companion=setup.companion, sampling=sampling_key(sampling)
    )
    profile.metrics["calibration_prompts"] = [p.id for p in prompts]
    profile.save(out)
    plot = out.with_suffix(".png")
    plot_calibration(report, plot, title=f"{target_name} / {draft_name} / companion {setup.companion}")
    print(
        f"{'rule':<6} {'predictor':<10} {'held-out log-loss':>18} {'floor':>7} {'Brier':>8} {'mean pred':>10} "
        f"{'mean gain':>10}"
    )
    for rule, kinds in report.items():
        for kind, m in kinds.items():
            print(
                f"{rule:<6} {kind:<10} {m['log_loss']:18.4f} {m['entropy_of_labels']:7.4f} {m['brier']:8.4f} "
                f"{m['mean_predicted']:10.3f} {m['mean_label']:10.3f}"
            )
    print(f"saved {out} and {plot}", file=sys.stderr)
    print(
        json.dumps(
            {"profile": str(out), "positions": profile.metrics["positions"], "held_out": profile.metrics["held_out"]}
        )
    )
    return 0


def check_output(path: Path, force: bool) -> None:
    """Before measuring (a calibration can take hours): refuse to replace a saved profile without ``force``, say
    which one ``force`` replaces, and make sure the folder can be written."""
    if path.exists():
        if not force:
            raise FileExistsError(
                f"{path} already holds a profile ({_held(path)}): pass --force to replace it, or --out to save "
                "elsewhere"
            )
        print(f"--force: the new profile will replace {path} ({_held(path)})", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # a file really made there: asking os.access can be wrong (NFS, ACLs, a root that squashes)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise PermissionError(
            f"cannot write to {path.parent} ({error.strerror}): pass --out to save the profile elsewhere"
        ) from None


def _held(path: Path) -> str:
    """The models a saved profile was made for, in a few words, from its JSON (a calibration profile's top level,
    a latency profile's meta)."""
    try:
        data = json.loads(path.read_text())
        fields = {**data.get("meta", data), "sampling": data.get("sampling")}
        said = [f"{field} {fields[field]}" for field in ("target", "draft", "companion")]
        said += [f"{field} {fields[field]}" for field in ("sampling", "date") if fields.get(field)]
        return ", ".join(said)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return "not readable as a profile"


def plot_calibration(report: dict, path: Path, title: str) -> None:
    """Held-out calibration curves: mean exact gain against mean predicted gain, per rule and predictor."""
    from ..bench.report import new_figure

    figure, axes = new_figure(len(report), title)
    for ax, (rule, kinds) in zip(axes, report.items()):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for kind, m in kinds.items():
            predicted, observed, _ = zip(*m["curve"])
            ax.plot(predicted, observed, marker="o", label=f"{kind} (log-loss {m['log_loss']:.3f})")
        ax.set(
            title=f"{rule} rule",
            xlabel="predicted gain",
            ylabel="exact gain (held-out mean)",
            xlim=(0, 1),
            ylim=(0, 1),
        )
        ax.legend()
    figure.savefig(path, dpi=110)
