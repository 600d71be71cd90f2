"""The `gptrun` command line: a thin shell over gptcore (model world) and experiments (Ray world).

Exit status: 0 success, 2 bad input or usage (one line on stderr, no traceback), 1 a failure at
run time. Heavy imports (torch, ray) happen inside the handlers so that `--help` is instant.
Each subcommand is a pair of functions: `_NAME_command` declares its options, `_NAME` runs it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from gptcore.errors import DivergedError, UserError


class Subcommands(Protocol):
    """What `add_subparsers()` returns, as far as the commands use it (argparse's own class for
    it is private)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


EPILOG = """\
examples:
  gptrun prepare --corpus shakespeare --out data/shakespeare
  gptrun train experiments/configs/quickstart.toml --local
  gptrun train experiments/configs/quickstart.toml --workers 2
  gptrun sample runs/quickstart/checkpoints/last.pt --prompt "ROMEO:"
  gptrun sample runs/quickstart-sft/checkpoints/best.pt --chat --interactive
  gptrun export runs/quickstart/checkpoints/best.pt --hf exports/quickstart
  gptrun plan experiments/configs/quickstart.toml
  gptrun sweep experiments/configs/quickstart.toml --name demo
  gptrun sweep experiments/configs/quickstart.toml --name demo2 --warm-start sweeps/demo
  gptrun resume sweeps/demo
  gptrun confirm sweeps/demo --top 3 --seeds 3
  gptrun report sweeps/demo
  gptrun transfer sweeps/proxy --to target.toml
  gptrun scale series.toml --name mini
  gptrun scale series/mini --predict --gpu-hours 8 --gpu H100 --mfu 0.4
  gptrun doctor --address auto
"""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2, like every other bad input, rather
    than the usage text before the line. Subcommands' parsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def finite(text: str) -> float:
    """The type of every float option: float() takes 'inf' and 'nan', which slip past range
    checks such as `< 0` ('nan < 0' is false) and fail later, far from the option."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number")
    return value


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)",
    )


def _add_cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: 'auto', 'host:port' or 'ray://host:10001' "
        "(default: start a local Ray instance)",
    )
    p.add_argument(
        "--storage",
        default=None,
        help="where runs and checkpoints live: a path shared by all nodes, or an s3:// / gs:// URI",
    )


def _prepare_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "prepare",
        help="train a BPE tokenizer and write uint16 token shards",
        description="Read a corpus, train (or reuse) a byte-level BPE tokenizer and "
        "write tokenizer.json, train/val uint16 .npy shards and meta.json "
        "into --out, atomically.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", help="a built-in corpus: shakespeare, kjv, python-stdlib")
    src.add_argument(
        "--input", nargs="+", metavar="PATH", help=".txt, .jsonl, .parquet files or folders of them"
    )
    p.add_argument("--out", required=True, help="output folder")
    # None: not given (see PRETRAINING_ONLY).
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (default 6400)")
    p.add_argument(
        "--text-field", default=None, help="JSONL field / parquet column holding the text (default: text)"
    )
    p.add_argument(
        "--val-fraction",
        type=finite,
        default=None,
        help="fraction held out for validation (default: 1%% of the documents or enough for ~300k "
        "tokens, whichever is more, capped at 10%%; with --sft 5%%: every 20th conversation)",
    )
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json instead of training")
    p.add_argument(
        "--errors",
        choices=("strict", "replace"),
        default=None,
        help="what to do with bytes that are not UTF-8 (default: strict = stop)",
    )
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: CPUs)")
    p.add_argument(
        "--tokenizer-sample-mb",
        type=finite,
        default=None,
        help="train the tokenizer on about this many MB of the train documents, drawn evenly over "
        "the corpus (default 8; BPE training's memory grows with the text it sees)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if --out is up to date")
    p.add_argument(
        "--sft",
        action="store_true",
        help='conversations for SFT: chat .jsonl files ({"conversations": [{"role", "content"}, ...]} '
        "per line), or with --corpus shakespeare the built-in toy set; needs --tokenizer "
        "(the pretraining data's tokenizer.json); takes --val-fraction and --force",
    )
    p.set_defaults(handler=_prepare)


# Options of pretraining data only, and why --sft refuses each (given alone, they keep the
# defaults of gptcore.prepare.prepare).
PRETRAINING_ONLY = {
    "vocab_size": "the vocabulary is --tokenizer's",
    "text_field": 'each line\'s conversation is its "conversations" field',
    "errors": "chat .jsonl files must be UTF-8",
    "workers": "the tokenizer's own threads encode conversations",
    "tokenizer_sample_mb": "--sft trains no tokenizer",
}


def _prepare(args: argparse.Namespace) -> int:
    if args.sft:
        from gptcore.chat_data import prepare_sft

        for dest, reason in PRETRAINING_ONLY.items():
            if getattr(args, dest) is not None:
                raise UserError(f"--{dest.replace('_', '-')} does not apply to --sft ({reason}); drop it")
        if not args.tokenizer:
            raise UserError(
                "--sft needs --tokenizer: the tokenizer.json of the data the model was pretrained on"
            )
        prepare_sft(
            args.input or [],
            args.corpus,
            tokenizer=args.tokenizer,
            out=args.out,
            val_fraction=args.val_fraction,
            force=args.force,
        )
        return 0
    from gptcore.prepare import prepare

    given = {dest: getattr(args, dest) for dest in PRETRAINING_ONLY if getattr(args, dest) is not None}
    prepare(
        inputs=args.input or [],
        corpus=args.corpus,
        out=args.out,
        val_fraction=args.val_fraction,
        tokenizer=args.tokenizer,
        force=args.force,
        **given,
    )
    return 0


def _train_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "train",
        help="train one model (Ray Train, or in-process with --local)",
        description="Train one model from an experiment TOML. Without --local it "
        "runs as a Ray Train job (DDP over --workers); running the same "
        "command again resumes from the last checkpoint.",
    )
    p.add_argument("config", help="experiment TOML, e.g. experiments/configs/quickstart.toml")
    p.add_argument("--data", default=None, help="prepared data folder (overrides data.dir)")
    p.add_argument(
        "--out",
        default=None,
        help="run folder: with --local it overrides train.out; on Ray it is the run's folder "
        "(instead of --storage/--name, default runs/ray/NAME)",
    )
    p.add_argument("--local", action="store_true", help="train in this process, without Ray")
    p.add_argument("--workers", type=int, default=None, help="DDP workers (resources.workers)")
    p.add_argument("--gpus-per-worker", type=finite, default=None)
    p.add_argument("--cpus-per-worker", type=finite, default=None)
    p.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="worker-group restarts from the last checkpoint (default 3)",
    )
    p.add_argument("--name", default=None, help="Ray run name (default: from the config)")
    _add_cluster(p)
    _add_overrides(p)
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from experiments.ray_config import load_experiment

    overrides = list(args.overrides)
    if args.data:
        overrides.append(f"data.dir={_toml_str(args.data)}")
    if args.out:
        overrides.append(f"train.out={_toml_str(args.out)}")
    for flag, key in (
        ("workers", "workers"),
        ("gpus_per_worker", "gpus_per_worker"),
        ("cpus_per_worker", "cpus_per_worker"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"resources.{key}={getattr(args, flag)}")
    cfg = load_experiment(args.config, overrides)
    if args.local:
        from gptcore.run import train_local

        train_local(cfg)
        return 0
    from experiments.cluster import resolve_address
    from experiments.ray_train import ray_run_folder, train_on_ray

    storage, name = ray_run_folder(args.out, args.storage, args.name)
    return train_on_ray(
        cfg, address=resolve_address(args.address), storage=storage, name=name, max_failures=args.max_failures
    )


def _sample_command(sub: Subcommands) -> None:
    p = sub.add_parser("sample", help="generate text from a checkpoint, or chat with it")
    p.add_argument(
        "checkpoint", help="a .pt checkpoint written by gptrun train, or a Ray Train checkpoint folder"
    )
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=finite, default=0.8)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=finite, default=1.0, help="1.0 disables nucleus sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the prefix every token")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep sampling past <|endoftext|> (the end of a training document)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="chat: --prompt is the user's message; prints the assistant's reply (up to <|im_end|>)",
    )
    p.add_argument("--system", default=None, help="with --chat: a system message before the conversation")
    p.add_argument(
        "--interactive",
        action="store_true",
        help="with --chat: read the user's turns from stdin, one per line, until EOF",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (default: the one the checkpoint carries)"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    p.set_defaults(handler=_sample)


def _sample(args: argparse.Namespace) -> int:
    from gptcore.sample import sample_cli

    sample_cli(
        args.checkpoint,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        use_cache=not args.no_cache,
        tokenizer=args.tokenizer,
        device=args.device,
        ignore_eos=args.ignore_eos,
        chat=args.chat,
        system=args.system,
        interactive=args.interactive,
    )
    return 0


def _export_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model folder",
        description="Write a checkpoint as a Hugging Face folder: safetensors weights, config.json "
        "(GPT2LMHeadModel or LlamaForCausalLM), generation_config.json and the tokenizer with its "
        "special tokens and chat template; transformers loads it offline with "
        "AutoModelForCausalLM / AutoTokenizer.from_pretrained(DIR).",
    )
    p.add_argument(
        "checkpoint", help="a .pt checkpoint written by gptrun train, or a Ray Train checkpoint folder"
    )
    p.add_argument("--hf", required=True, metavar="DIR", help="the folder to write (must be new or empty)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (default: the one the checkpoint carries)"
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --hf folder")
    p.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    from gptcore.export import export_hf

    hf_model = export_hf(args.checkpoint, args.hf, tokenizer=args.tokenizer, force=args.force)
    print(
        f"exported {type(hf_model).__name__} ({hf_model.num_parameters():,} parameters) and its "
        f"tokenizer to {args.hf}; load it with AutoModelForCausalLM.from_pretrained({args.hf!r})"
    )
    return 0


def _plan_command(sub: Subcommands) -> None:
    p = sub.add_parser("plan", help="what a sweep will cost, before it runs")
    p.add_argument("config")
    p.add_argument(
        "--tokens-per-sec",
        type=finite,
        default=None,
        help="per-trial throughput; default: measured by a short probe",
    )
    p.add_argument("--cpus", type=finite, default=None, help="cluster CPUs (default: this machine)")
    p.add_argument("--gpus", type=finite, default=None, help="cluster GPUs (default: this machine)")
    p.add_argument(
        "--address",
        default=None,
        help="size the plan to this Ray cluster (or $RAY_ADDRESS): its CPUs and GPUs, or the most "
        "its autoscaler can add",
    )
    _add_overrides(p)
    p.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    from experiments.cluster import resolve_address
    from experiments.plan import plan_cli

    return plan_cli(
        args.config,
        args.overrides,
        tokens_per_sec=args.tokens_per_sec,
        cpus=args.cpus,
        gpus=args.gpus,
        address=resolve_address(args.address),
    )


def _sweep_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "sweep",
        help="Optuna (TPE) + ASHA search over lr, weight decay, warmup",
        description="Run a Ray Tune sweep. Kill it at any time; `gptrun resume` "
        "continues it without losing trials.",
    )
    p.add_argument("config")
    p.add_argument("--name", default=None, help="experiment name (default: config name)")
    p.add_argument(
        "--restart",
        action="store_true",
        help="delete an existing experiment of this name (and its study) and start over, once "
        "every check has passed",
    )
    p.add_argument(
        "--replace-study",
        action="store_true",
        help="with --restart: also delete a study of this name in sweep.storage_url that this "
        "experiment did not create",
    )
    p.add_argument(
        "--warm-start",
        metavar="SWEEP",
        default=None,
        help="start TPE from the finished trials of an earlier sweep on the same search space: its "
        "folder (e.g. sweeps/NAME), or a study name in sweep.storage_url (sets sweep.warm_start)",
    )
    _add_cluster(p)
    _add_overrides(p)
    p.set_defaults(handler=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    from experiments.cluster import ray_session, resolve_address
    from experiments.sweep import plan_sweep, run_sweep

    if args.replace_study and not args.restart:
        raise UserError("--replace-study goes with --restart (it replaces the experiment's study)")
    address = resolve_address(args.address)
    overrides = list(args.overrides)
    if args.warm_start:
        overrides.append(f"sweep.warm_start={_toml_str(args.warm_start)}")
    plan = plan_sweep(
        args.config,
        overrides,
        name=args.name,
        storage=args.storage,
        restart=args.restart,
        address=address,
        replace_study=args.replace_study,
    )
    with ray_session(address, extra_local_cpus=plan.extra_local_cpus):
        return _then_confirm(run_sweep(plan), plan)


def _resume_command(sub: Subcommands) -> None:
    p = sub.add_parser("resume", help="continue an interrupted sweep")
    p.add_argument("experiment_dir", help="the sweep's folder, or its URI (s3://bucket/prefix/NAME)")
    p.add_argument("--address", default=None)
    p.set_defaults(handler=_resume)


def _resume(args: argparse.Namespace) -> int:
    from experiments.cluster import ray_session, resolve_address
    from experiments.sweep import plan_resume, run_resume

    address = resolve_address(args.address)
    plan = plan_resume(args.experiment_dir)
    with ray_session(address, extra_local_cpus=plan.extra_local_cpus):
        return _then_confirm(run_resume(plan), plan)


def _then_confirm(status: int, plan: Any) -> int:
    """With `sweep.confirm_top`, the noise check runs after a successful search, in its session."""
    top = plan.cfg.sweep.confirm_top
    if status != 0 or not top:
        return status
    from experiments.confirm import confirm, confirm_plan

    confirm_run = confirm_plan(plan.exp_dir, plan.cfg, top, plan.cfg.sweep.confirm_seeds)
    return confirm(plan.exp_dir, plan.cfg, confirm_run, restart=False)


def _confirm_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "confirm",
        help="re-run the best configs with new seeds: what is noise",
        description="Re-run the K best completed trials of a sweep with S new "
        "seeds at full length, report mean +- std for each and whether "
        "the best is separated from the runner-up (Welch t-test). "
        "Writes EXPERIMENT_DIR/noise.json; `gptrun report` shows it. "
        "Killed, the same command resumes it.",
    )
    p.add_argument("experiment_dir", help="the sweep's folder, or its URI (s3://bucket/prefix/NAME)")
    p.add_argument("--top", type=int, default=3, help="how many of the best configs (default 3)")
    p.add_argument("--seeds", type=int, default=3, help="new seeds per config (default 3)")
    p.add_argument(
        "--restart", action="store_true", help="replace an earlier confirm with a different --top / --seeds"
    )
    p.add_argument("--address", default=None)
    p.set_defaults(handler=_confirm)


def _confirm(args: argparse.Namespace) -> int:
    from experiments.cluster import resolve_address
    from experiments.confirm import confirm_cli

    return confirm_cli(
        args.experiment_dir,
        top=args.top,
        seeds=args.seeds,
        address=resolve_address(args.address),
        restart=args.restart,
    )


def _report_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "report",
        help="tables, plots, report.html and best.toml for a sweep; the runs and fits of a series",
    )
    p.add_argument(
        "experiment_dir",
        help="the sweep's folder, or its URI (s3://bucket/prefix/NAME); or a `gptrun scale` series' "
        "folder (its fits.json and scaling.png are rewritten in it)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="where to write (default: EXPERIMENT_DIR/report; for a URI, NAME-report here; not for a series)",
    )
    p.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from experiments.report import report_cli

    return report_cli(args.experiment_dir, out=args.out)


def _transfer_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "transfer",
        help="a µP sweep's best values as a training config for a wider model",
        description="Take the best trial of a sweep run on a narrow µP proxy (model.mup_base_width "
        "set) and write TARGET's config with the proxy's lr, weight decay, warmup (and any other "
        "optimizer key the sweep searched) and µP base width, printing both side by side. "
        "Refused when proxy and target differ in what µP does not transfer (depth, d_head, "
        "vocabulary/tokenizer, sequence length, batch, schedule).",
    )
    p.add_argument("sweep", help="the sweep's experiment folder, e.g. sweeps/proxy")
    p.add_argument("--to", required=True, metavar="TARGET.toml", help="the wide model's experiment TOML")
    p.add_argument("--out", default=None, help="the config to write (default: SWEEP/transfer-TARGET.toml)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--horizon-exponent",
        type=finite,
        default=0.0,
        help="scale lr by (target tokens / proxy tokens)^-EXPONENT: an empirical rule for longer "
        "runs (~0.3 is reported for AdamW), not part of µP (default 0: off)",
    )
    p.set_defaults(handler=_transfer)


def _transfer(args: argparse.Namespace) -> int:
    from experiments.transfer import transfer_cli

    return transfer_cli(
        args.sweep, args.to, out=args.out, horizon_exponent=args.horizon_exponent, force=args.force
    )


# Each subcommand's options, next to its handler, in the order `gptrun --help` lists them.
def _scale_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "scale",
        help="a miniseries of model sizes x compute budgets, its scaling laws, a forecast",
        description="gptrun scale CONFIG runs the series of the config's [scale] table (budgets "
        "x widths, each run trained to its own length, in parallel on the cluster; killed, the "
        "same command resumes it), then fits it: the IsoFLOP profiles with N*(C) and D*(C), and "
        "L(N, D) = E + A/N^alpha + B/D^beta, with bootstrap intervals. gptrun scale SERIES "
        "--predict forecasts a larger budget: its compute-optimal size and tokens, the loss to "
        "expect and a config to train. See docs/scaling.md.",
    )
    p.add_argument("target", help="a config with a [scale] table; with --predict, a series folder")
    p.add_argument("--name", default=None, help="the series' name (default: the config's name)")
    p.add_argument(
        "--restart", action="store_true", help="replace a series of this name with a different plan"
    )
    p.add_argument("--plan", action="store_true", help="print the series' runs and stop")
    p.add_argument("--predict", action="store_true", help="forecast a budget from a finished series")
    p.add_argument("--flops", type=finite, default=None, help="with --predict: the budget in training FLOPs")
    p.add_argument(
        "--gpu-hours",
        type=finite,
        default=None,
        help="with --predict: the budget in GPU-hours (with --gpu, --mfu)",
    )
    p.add_argument("--gpu", default="H100", help="the GPU whose bf16 peak --gpu-hours uses (default H100)")
    p.add_argument("--mfu", type=finite, default=0.4, help="the MFU --gpu-hours assumes (default 0.4)")
    _add_cluster(p)
    _add_overrides(p)
    p.set_defaults(handler=_scale)


def _scale(args: argparse.Namespace) -> int:
    # One BLAS thread for the fits, set before numpy loads it: scipy's L-BFGS-B calls LAPACK at
    # every step, and OpenBLAS's threads beside other work made a forecast 5-15x slower.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from experiments.cluster import resolve_address
    from experiments.scale import predict_cli, scale_cli

    if args.predict:
        return predict_cli(
            args.target, flops=args.flops, gpu_hours=args.gpu_hours, gpu=args.gpu, mfu=args.mfu
        )
    if args.flops is not None or args.gpu_hours is not None:
        raise UserError("--flops and --gpu-hours go with --predict (a forecast from a finished series)")
    return scale_cli(
        args.target,
        args.overrides,
        name=args.name,
        storage=args.storage,
        restart=args.restart,
        address=resolve_address(args.address),
        plan_only=args.plan,
    )


def _doctor_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this installation (and a cluster): versions, private names, bf16, compile",
        description="Print the versions of gptrun, torch, Ray and Optuna, check every private "
        "name of theirs that gptrun relies on, and probe what train.precision = auto and "
        "train.compile meet here. With --address (or $RAY_ADDRESS) every alive node of the "
        "cluster is checked too. One line per problem; exit status 1 if there is any.",
    )
    p.add_argument("--address", default=None, help="a Ray cluster to check too: 'auto' or 'host:port'")
    p.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from experiments.doctor import run_doctor

    return run_doctor(args.address)


COMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    _prepare_command,
    _train_command,
    _sample_command,
    _export_command,
    _plan_command,
    _sweep_command,
    _resume_command,
    _confirm_command,
    _report_command,
    _transfer_command,
    _scale_command,
    _doctor_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="gptrun",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="Train small GPTs from scratch and sweep their hyperparameters on Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in COMMANDS:
        add_command(sub)
    return parser


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv: Sequence[str] | None = None) -> int:
    # Each log line of a Ray worker or trial once, in order: Ray's deduplication would hold
    # repeated-looking progress lines back and print them later as "[repeated Nx]".
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray Train routes a worker's print() through its logger, which prints it a second time.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except UserError as err:
        print(f"gptrun {args.command}: error: {err}", file=sys.stderr)
        return 2
    except DivergedError as err:
        print(f"gptrun {args.command}: diverged: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gptrun {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
