"""The `evalrun` command: parse, call the library, map errors to exit codes.

Exit codes: 0 success; 1 a check failed; 2 the command could not do its job (one line on stderr).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable

import click

from . import report
from .config import build_config, parse_opt_level
from .errors import EvalrunError
from .store import Store, default_store_path

RUN_FLAG_NAMES = ("model", "prompts", "opt_level", "compilation_mode", "cudagraph_mode", "dtype", "device",
                  "max_new_tokens", "batch_size", "deterministic", "strict_config", "keep_logits")


class Failure(Exception):
    """Raised inside a command to exit with `code` after printing `message` (if any) to stderr."""

    def __init__(self, message: str | None, code: int):
        super().__init__(message)
        self.message, self.code = message, code


def run_options(command: Callable) -> Callable:
    """The RUN OPTIONS of DESIGN.md, defined once for every command that runs a model."""
    options = [
        click.option("--config", "config_source", metavar="PRESET|FILE.toml", help="Preset name or TOML file."),
        click.option("--model", help="smollm2-135m (default), random:tiny, random:smollm2, random:llama3-8b, DIR, FILE.gguf."),
        click.option("--prompts", metavar="FILE.jsonl", help="Prompt set: default, smoke, or a JSONL file."),
        click.option("-O", "--opt-level", "opt_level", metavar="N", help="Optimization level 0-3."),
        click.option("--compilation-mode", metavar="M", help="none|stock|trace-once|piecewise (or vLLM names)."),
        click.option("--cudagraph-mode", metavar="M", help="none|piecewise|full|full-decode-only|full-and-piecewise."),
        click.option("--dtype", metavar="T", help="float32|bfloat16|float16 (default: float32 on CPU, bfloat16 on GPU)."),
        click.option("--device", metavar="D", help="auto|cpu|cuda[:N]."),
        click.option("--max-new-tokens", type=int, help="Tokens to generate per prompt."),
        click.option("--batch-size", type=int, help="Prompts per batch."),
        click.option("--deterministic/--no-deterministic", default=None, help="Deterministic algorithms and flags."),
        click.option("--strict-config", is_flag=True, default=None, help="A fallback from the requested mode is an error."),
        click.option("--keep-logits", metavar="none|all", help="Store full logits of every step (compressed)."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Set any config key (repeatable)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")


def run_flags(kwargs: dict[str, Any]) -> tuple[str | None, dict[str, Any], tuple[str, ...]]:
    """Pop the RUN OPTIONS out of a command's kwargs: (config source, explicit flags, --set items)."""
    flags = {name: kwargs.pop(name, None) for name in RUN_FLAG_NAMES}
    if flags["opt_level"] is not None:
        flags["opt_level"] = parse_opt_level(flags["opt_level"])
    return kwargs.pop("config_source", None), flags, kwargs.pop("sets", ())


def config_from(kwargs: dict[str, Any]):
    return build_config(*run_flags(kwargs))


def progress_factory(quiet: bool):
    """A click progress bar on stderr, one tick per prompt; nothing when quiet."""
    if quiet:
        return None

    def make(total: int):
        return click.progressbar(length=total, label="generating", file=sys.stderr, show_pos=True)

    return make


def phase_progress(quiet: bool):
    """For multi-run commands: (phase, total) -> update callable drawing one bar per phase on stderr."""
    if quiet:
        return None

    def start(phase: str, total: int):
        bar = click.progressbar(length=total, label=f"{phase:>9}", file=sys.stderr, show_pos=True)
        bar.__enter__()

        def update(count: int) -> None:
            bar.update(count)
            if bar.pos >= total:
                bar.__exit__(None, None, None)

        return update

    return start


def handle_errors(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except EvalrunError as error:
            raise Failure(f"evalrun: error: {error}", 2) from None
    return wrapper


def store_option(command: Callable) -> Callable:
    return click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
                        help="Store file (default: $EVALRUN_STORE or store/evalrun.db).")(command)


def open_store(store_path: Path | None, create: bool = True) -> Store:
    return Store(store_path or default_store_path(), create=create)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="evalrun")
def cli() -> None:
    """evalrun: is it numerical drift or a real model change?

    \b
    Example:
      evalrun run --model random:tiny --prompts smoke --json
    """


@cli.command()
@run_options
@store_option
@click.option("--label", help="A note stored with the run.")
@json_option
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@handle_errors
def run(store_path, label, as_json, quiet, **kwargs) -> None:
    """Run the prompt set, capture every step's logits, store the run.

    \b
    Example:
      evalrun run --model random:tiny --prompts smoke --max-new-tokens 8 --json
    """
    from .runner import execute_run

    config = config_from(kwargs)
    store = open_store(store_path)
    outcome = execute_run(config, store, label=label, progress_factory=progress_factory(quiet))
    if as_json:
        click.echo(report.to_json(report.run_json(outcome.run_id, outcome.header, outcome.results, outcome.timings,
                                                  outcome.evidence, outcome.tokens_digest, outcome.logits_digest)))
    else:
        click.echo(report.run_text(outcome.run_id, outcome.header, outcome.results, outcome.timings, outcome.evidence))
    if outcome.evidence.get("fallbacks") and outcome.header["config"]["strict_config"]:
        raise Failure("evalrun: error: the requested mode fell back (" + "; ".join(outcome.evidence["fallbacks"])
                      + "); drop --strict-config or fix the cause", 2)


@cli.command()
@run_options
@json_option
@handle_errors
def fingerprint(as_json, **kwargs) -> None:
    """Show the effective config, environment, model identity and prompt-set hash.

    \b
    Example:
      evalrun fingerprint --model random:tiny --json
    """
    from .runner import prepare

    header = prepare(config_from(kwargs)).header
    click.echo(report.to_json(header) if as_json else report.fingerprint_text(header))


@cli.group()
def store() -> None:
    """List, show and check stored runs.

    \b
    Example:
      evalrun store ls
    """


@store.command("ls")
@store_option
@click.option("--limit", type=int, default=50, show_default=True, help="Newest runs to list.")
@json_option
@handle_errors
def store_ls(store_path, limit, as_json) -> None:
    """List runs, newest first.

    \b
    Example:
      evalrun store ls --limit 10 --json
    """
    runs = open_store(store_path, create=False).list_runs(limit)
    click.echo(report.to_json([r.summary() for r in runs]) if as_json else report.runs_table(runs))


@store.command("show")
@click.argument("run_id")
@store_option
@json_option
@handle_errors
def store_show(run_id, store_path, as_json) -> None:
    """Show one run by id or unique prefix.

    \b
    Example:
      evalrun store show 3f2a
    """
    db = open_store(store_path, create=False)
    record = db.get_run(run_id)
    results = db.load_results(record.id, names=("tokens", "margins"))
    if as_json:
        click.echo(report.to_json({**record.summary(), **record.json, "error": record.error,
                                   "results": [{"prompt_id": r.prompt_id, "text": r.output_text,
                                                "tokens": r.arrays["tokens"].tolist(),
                                                "logits_digest": r.logits_digest} for r in results]}))
    else:
        click.echo(report.run_record_text(record, results))


@store.command("check")
@store_option
@json_option
@handle_errors
def store_check(store_path, as_json) -> None:
    """Check the store: SQLite integrity, schema, orphan rows, incomplete runs (exit 1 on a problem).

    \b
    Example:
      evalrun store check --store store/evalrun.db
    """
    outcome = open_store(store_path, create=False).check()
    if as_json:
        click.echo(report.to_json(outcome))
    else:
        click.echo(f"{outcome['path']}: {'ok' if outcome['ok'] else 'PROBLEMS'}  schema {outcome['schema_version']}  "
                   f"runs {outcome['runs']}")
        for problem in outcome["problems"]:
            click.echo(f"  {problem}")
        for run_id in outcome["interrupted"]:
            click.echo(f"  note: run {run_id[:12]} was interrupted (its process is gone); it stays 'running', never complete")
    if not outcome["ok"]:
        raise Failure(None, 1)


@cli.group()
def golden() -> None:
    """Create, verify, list and show goldens (golden/NAME.db, committed to git).

    \b
    Example:
      evalrun golden verify smollm2-cpu
    """


dir_option = click.option("--dir", "directory", type=click.Path(path_type=Path), default=Path("golden"),
                          show_default=True, help="Folder of golden files.")


@golden.command("create")
@click.argument("name")
@run_options
@dir_option
@click.option("--force", is_flag=True, help="Overwrite an existing golden.")
@json_option
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@handle_errors
def golden_create(name, directory, force, as_json, quiet, **kwargs) -> None:
    """Run the pinned config, the reference config and the oracle; write golden/NAME.db.

    \b
    Example:
      evalrun golden create smollm2-cpu
    """
    from .golden import create_golden

    created = create_golden(name, config_from(kwargs), directory, force, phase_progress(quiet))
    summary = created.summary()
    click.echo(report.to_json(summary) if as_json else
               f"golden {summary['path']}: {summary['model']} {summary['dtype']} on {summary['device']}, "
               f"prompts {summary['prompts']}, oracle {summary['oracle_dtype']}, {summary['bytes']:,} bytes")


@golden.command("verify")
@click.argument("name")
@run_options
@dir_option
@click.option("--strict", is_flag=True, help="Drift fails too (exit 1).")
@click.option("--format", "output_format", type=click.Choice(["text", "json", "markdown"]), default="text",
              show_default=True, help="Output format on stdout.")
@click.option("--junit", "junit_path", type=click.Path(path_type=Path), help="Also write a JUnit XML report here.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@handle_errors
def golden_verify(name, directory, strict, output_format, junit_path, quiet, **kwargs) -> None:
    """Verify a candidate config against a golden: identical, drift, changed or incomparable.

    Exit 0 identical or drift (1 with --strict), 1 changed, 2 incomparable or cannot compare.

    \b
    Example:
      evalrun golden verify smollm2-cpu -O3 --format markdown > comment.md
    """
    from . import verdict_report
    from .golden import candidate_config, open_golden, verify_golden

    opened = open_golden(name, directory)
    config = candidate_config(opened, *run_flags(kwargs))
    verdict = verify_golden(opened, config, strict, phase_progress(quiet))
    click.echo(verdict_report.render(verdict, output_format))
    if junit_path:
        junit_path.write_text(verdict_report.junit(verdict, strict))
    if verdict.exit_code:
        raise Failure(f"evalrun: golden {name}: {verdict.verdict}" if verdict.exit_code == 2 else None,
                      verdict.exit_code)


@golden.command("list")
@dir_option
@json_option
@handle_errors
def golden_list(directory, as_json) -> None:
    """List the goldens in the folder.

    \b
    Example:
      evalrun golden list --json
    """
    from .golden import list_goldens

    entries = list_goldens(directory)
    if as_json:
        click.echo(report.to_json(entries))
        return
    rows = [[e["name"], e.get("model", ""), e.get("prompts", ""), e.get("device", ""), e.get("dtype", ""),
             e.get("oracle_dtype", ""), f"{e['bytes']:,}" if "bytes" in e else "", e.get("error", "")] for e in entries]
    click.echo(report.table(["golden", "model", "prompts", "device", "dtype", "oracle", "bytes", "problem"], rows))


@golden.command("show")
@click.argument("name")
@dir_option
@json_option
@handle_errors
def golden_show(name, directory, as_json) -> None:
    """Show a golden: its fingerprints, config and pinned outputs.

    \b
    Example:
      evalrun golden show smollm2-cpu
    """
    from .golden import open_golden

    opened = open_golden(name, directory)
    pinned = opened.pinned
    results = opened.results("pinned")
    if as_json:
        click.echo(report.to_json({**opened.summary(), "meta": opened.meta, **pinned.json,
                                   "results": [{"prompt_id": r.prompt_id, "text": r.output_text,
                                                "tokens": r.arrays["tokens"].tolist()} for r in results]}))
    else:
        summary = opened.summary()
        click.echo(f"golden {name} ({summary['path']}, {summary['bytes']:,} bytes), oracle {summary['oracle_dtype']}, "
                   f"created {summary['created_at']} by evalrun {summary['evalrun']}")
        click.echo(report.run_record_text(pinned, results))


@cli.command()
@click.argument("run_a")
@click.argument("run_b")
@store_option
@click.option("--golden-dir", type=click.Path(path_type=Path), default=Path("golden"), show_default=True,
              help="Folder of goldens for golden:NAME.")
@click.option("--prompt", "prompt_ids", multiple=True, metavar="ID", help="Only these prompts (repeatable).")
@click.option("--format", "output_format", type=click.Choice(["text", "json", "markdown"]), default="text",
              show_default=True, help="Output format on stdout.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG of per-step error.")
@handle_errors
def diff(run_a, run_b, store_path, golden_dir, prompt_ids, output_format, plot_path) -> None:
    """Explain the bit differences between two runs (ids, unique prefixes, or golden:NAME).

    \b
    Example:
      evalrun diff golden:smollm2-cpu 9c1e --format markdown
    """
    from . import diff_report
    from .diff import diff_runs, load_run

    needs_store = not (run_a.startswith("golden:") and run_b.startswith("golden:"))
    store = open_store(store_path, create=False) if needs_store else None
    a, b = load_run(run_a, store, golden_dir), load_run(run_b, store, golden_dir)
    result = diff_runs(a, b, tuple(prompt_ids), decode=_decoder(a))
    click.echo(diff_report.render(result, output_format))
    if plot_path:
        diff_report.plot(result, plot_path)


@cli.command()
@click.option("--model", help="Model reference (default smollm2-135m).")
@click.option("--prompts", metavar="FILE.jsonl", help="Prompt set.")
@click.option("--dtype", metavar="T", help="float32|bfloat16|float16.")
@click.option("--device", metavar="D", help="auto|cpu|cuda[:N].")
@click.option("--max-new-tokens", type=int, help="Tokens per prompt.")
@click.option("--batch-size", type=int, help="Prompts per batch.")
@click.option("--matrix", "matrix_names", metavar="NAMES", default=None,
              help="Comma-separated configs: -O0..-O3, none, stock, trace-once, piecewise "
                   "(default: -O0..-O3 on GPU, the compilation modes on CPU).")
@click.option("--no-baselines", is_flag=True, help="Skip transformers' generate baselines.")
@click.option("--config-timeout", type=click.FloatRange(min=1), default=3600, show_default=True, metavar="SECONDS",
              help="Stop a configuration that runs longer (its row shows the timeout); the others still run.")
@json_option
@handle_errors
def bench(model, prompts, dtype, device, max_new_tokens, batch_size, matrix_names, no_baselines, config_timeout,
          as_json) -> None:
    """Measure a matrix of configurations side by side, each in a fresh process, with transformers baselines.

    \b
    Example:
      evalrun bench --model random:llama3-8b --dtype bfloat16 --max-new-tokens 128 --prompts smoke
    """
    import torch

    from .bench import CPU_MATRIX, GPU_MATRIX, run_matrix, table_rows

    common = []
    for flag, value in (("--model", model), ("--prompts", prompts), ("--dtype", dtype), ("--device", device),
                        ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size)):
        if value is not None:
            common += [flag, str(value)]
    on_gpu = (device or "auto") != "cpu" and torch.cuda.is_available()
    matrix = GPU_MATRIX if on_gpu else CPU_MATRIX
    if matrix_names:
        known = {name: options for name, options in GPU_MATRIX + CPU_MATRIX}
        known.update({"none": ["--compilation-mode", "none"], "O0": ["-O0"], "O1": ["-O1"], "O2": ["-O2"], "O3": ["-O3"]})
        unknown = [n for n in matrix_names.split(",") if n not in known]
        if unknown:
            raise Failure(f"evalrun: error: unknown bench config {unknown[0]!r}; use {', '.join(sorted(known))}", 2)
        matrix = [(name, known[name]) for name in matrix_names.split(",")]
    rows = table_rows(run_matrix(common, matrix, not no_baselines,
                                 lambda name: click.echo(f"bench: {name}", err=True), config_timeout))
    if as_json:
        click.echo(report.to_json(rows))
    else:
        _print_bench_table(rows)
    failed = [row["config"] for row in rows if row.get("error")]
    if failed:
        raise Failure(f"evalrun: error: {len(failed)} of {len(rows)} bench configurations failed ({', '.join(failed)}); "
                      "their rows say why", 2)


def _print_bench_table(rows: list[dict]) -> None:
    headers = ["config", "compile s", "peak GiB", "TTFT ms", "first req ms", "tok/s", "p50 ms", "p95 ms", "p99 ms",
               "identical to first", "launches/step", "fallbacks / error"]
    keys = ["config", "compile_s", "peak_memory_gib", "ttft_ms", "first_request_ms", "tokens_per_s", "p50_ms",
            "p95_ms", "p99_ms", "identical_to_first", "kernel_launches_per_decode_step"]
    click.echo(report.table(headers, [[row.get(k) for k in keys] + ["; ".join(row.get("fallbacks") or [])
                                                                    or row.get("error") or ""] for row in rows]))


def _decoder(run):
    """Decode token ids with the run's tokenizer when it loads quickly; ids as text otherwise."""
    from .models import load_tokenizer_for

    try:
        tokenizer = load_tokenizer_for(run.record.json["model"]["ref"])
    except Exception:  # noqa: BLE001 - decoding is a convenience; ids still identify tokens
        return None
    return lambda ids: tokenizer.decode(ids)


def main(argv: list[str] | None = None) -> None:
    """Entry point: click in non-standalone mode so every error becomes one line and exit 2."""
    try:
        cli.main(args=argv, prog_name="evalrun", standalone_mode=False)
    except Failure as failure:
        if failure.message:
            click.echo(failure.message, err=True)
        sys.exit(failure.code)
    except click.exceptions.Abort:
        click.echo("evalrun: aborted", err=True)
        sys.exit(2)
    except click.exceptions.ClickException as error:
        click.echo(f"evalrun: error: {error.format_message()}; see evalrun --help", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("evalrun: interrupted", err=True)
        sys.exit(2)
    sys.exit(0)
