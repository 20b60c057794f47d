"""The `evalrun` command: parse, call one library function, render. Errors are mapped once, in `main()`.

Exit codes (errors.py): 0 success; 1 a check failed; 2 the command could not do its job (one line on
stderr); 3 evalrun itself failed (one line naming the file that holds the traceback).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import os
import signal
import sqlite3
import stat
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import click

from . import report
from .config import build_config, parse_opt_level
from .errors import EXIT_CHANGED, EXIT_INTERNAL, EXIT_UNUSABLE, ConfigError, EvalrunError, OutputError, Terminated
from .store import Store, check_store_path, default_store_path
from .store_check import check_store

RUN_FLAG_NAMES = ("model", "prompts", "engine", "served_model", "tensor_parallel", "opt_level", "compilation_mode", "cudagraph_mode", "dtype", "device",
                  "max_new_tokens", "batch_size", "deterministic", "strict_config", "keep_logits")


class Exit(Exception):
    """Raised inside a command to exit with `code`, printing `message` (if any) to stderr."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message)
        self.code, self.message = code, message


_output_printed = False  # whether the command printed its output: an error after it adds no JSON document


def emit(text: str) -> None:
    """The command's output on stdout (its one JSON, Markdown or text document; a GitHub annotation line). A reader
    that stopped reading (`| head`, `| true`) does not stop the command: the rest of its work (a stored run, a
    --junit file) is done and its exit code stands."""
    global _output_printed
    _output_printed = True
    try:
        click.echo(text)
    except OSError as error:
        if error.errno != errno.EPIPE:
            raise
        try:  # what is left to print goes nowhere, as the reader chose (and nothing fails flushing it at exit)
            sink = os.open(os.devnull, os.O_WRONLY)
            os.dup2(sink, sys.stdout.fileno())
            os.close(sink)
        except (OSError, ValueError, AttributeError):  # a stdout with no file descriptor
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115


def _leader_or_unknown() -> bool:
    """Whether this process prints (rank 0 under torchrun), True where that cannot be told."""
    try:
        return leader()
    except Exception:  # noqa: BLE001 - the error being reported may be the process group's own
        return True


def json_requested(argv: list[str]) -> bool:
    """Whether the command line asks for JSON output, read from the words themselves (an error can come before click
    has parsed them) as click reads them: `--json` wins (`chosen_format`), else the last `--format`; the word after an
    option that takes a value is that value (`--label --json` names a label), and none after `--` is an option."""
    chosen, words, taking_a_value = "text", iter(argv), options_taking_a_value()
    for word in words:
        if word == "--":
            break
        if word == "--json":
            return True
        if word.startswith("--format="):
            chosen = word.removeprefix("--format=")
        elif word == "--format":
            chosen = next(words, chosen)
        elif word in taking_a_value:
            next(words, None)
    return chosen == "json"


def options_taking_a_value() -> frozenset[str]:
    """Every option word of evalrun's commands whose next word is its value."""
    words: set[str] = set()
    commands: list[click.Command] = [cli]
    while commands:
        command = commands.pop()
        commands.extend(getattr(command, "commands", {}).values())
        words.update(word for param in command.params if isinstance(param, click.Option)
                     and not param.is_flag and not param.count for word in param.opts)
    return frozenset(words)


def run_options(command: Callable) -> Callable:
    """The RUN OPTIONS of DESIGN.md, defined once for every command that runs a model."""
    options = [
        click.option("--config", "config_source", metavar="PRESET|FILE.toml", help="Preset name or TOML file."),
        click.option("--model", help="smollm2-135m (default), random:tiny|smollm2|llama3-8b|qwen3-8b|qwen3-moe, "
                                        "DIR, FILE.gguf."),
        click.option("--prompts", metavar="FILE.jsonl", help="Prompt set: default, smoke, or a JSONL file."),
        click.option("--engine", metavar="E", help="evalrun (default) | transformers | openai:http://HOST:PORT/v1."),
        click.option("--served-model", metavar="NAME", help="With --engine openai:URL: the served model's name."),
        click.option("--tensor-parallel", type=int, metavar="N", help="Split the model across N ranks (torchrun)."),
        click.option("-O", "--opt-level", "opt_level", metavar="N", help="Optimization level 0-3."),
        click.option("--compilation-mode", metavar="M", help="none|stock|trace-once|piecewise (or vLLM names)."),
        click.option("--cudagraph-mode", metavar="M", help="none|piecewise|full|full-decode-only|full-and-piecewise."),
        click.option("--dtype", metavar="T", help="float32|bfloat16|float16|float64 (default: float32 on CPU, bfloat16 on GPU)."),
        click.option("--device", metavar="D", help="auto|cpu|cuda[:N]."),
        click.option("--max-new-tokens", type=int, help="Tokens to generate per prompt."),
        click.option("--batch-size", type=int, help="Prompts per batch."),
        click.option("--deterministic/--no-deterministic", default=None, help="Deterministic algorithms and flags."),
        click.option("--strict-config", is_flag=True, default=None, help="A fallback from the requested mode is an error."),
        click.option("--keep-logits", metavar="none|all|ID@A-B,...", help="Store full logits (compressed) for diffs."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Set any config key (repeatable)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def output_options(*formats: str) -> Callable:
    """`--format` (one of `formats`) and `--json` (its alias for json), the same on every command."""

    def decorate(command: Callable) -> Callable:
        command = click.option("--json", "as_json", is_flag=True, help="Same as --format json.")(command)
        return click.option("--format", "output_format", type=click.Choice(formats), default=formats[0],
                            show_default=True, help="Output format on stdout.")(command)

    return decorate


def chosen_format(output_format: str, as_json: bool) -> str:
    return "json" if as_json else output_format


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


def shard_option(command: Callable) -> Callable:
    return click.option("--shard", "shard_text", metavar="I/N", default=None,
                        help="Run part I of N of the prompt set (whole batches; CI matrix jobs, Slurm arrays); "
                             "join the stores with `evalrun store merge`. Under torchrun the ranks split it.")(command)


def parsed_shard(text: str | None):
    from .distributed import parse_shard

    return parse_shard(text) if text is not None else None


def leader() -> bool:
    """Whether this process prints and writes: always, except on ranks > 0 under torchrun."""
    from .distributed import world

    return world().leader


def store_option(command: Callable) -> Callable:
    return click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
                        help="Store file (default: $EVALRUN_STORE or store/evalrun.db).")(command)


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")


def open_store(store_path: Path | None, readonly: bool = False, require_schema: bool = True) -> Store:
    """The store for a command: read-only for commands that only read (no migration, no journal switch)."""
    return Store(store_path or default_store_path(), readonly=readonly, require_schema=require_schema)


def _store_once_input_is_good(store_path: Path | None) -> Callable[[], Store]:
    """The store checked now, before a model loads, and opened (created) by the returned function once the model,
    prompts and config are good: a command refused for its input leaves no new store file."""
    path = store_path or default_store_path()
    check_store_path(path)
    return lambda: open_store(path)


def writable_output(path: Path | None, what: str, *taken: Path | None) -> None:
    """Check an output path before any model runs: its folder exists and can be written, and it is none of
    `taken` (the command's store, its golden) nor any SQLite file (a store or a golden it would destroy)."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise OutputError(f"{what} {path}: cannot write there (is its folder there and writable?); pass another path")
    if any(other is not None and os.path.abspath(other) == os.path.abspath(path) for other in taken) \
            or _is_sqlite_file(path):
        raise OutputError(f"{what} {path} is one of the command's inputs (its store, golden, prompts or config) or "
                          f"a SQLite file; writing there would destroy it: pass another path")
    _try_opening_for_writing(path, what)


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # subprocess's wait overflows past ~24 days (milliseconds in a C int)


def timeout_seconds(context: click.Context, param: click.Parameter, value: float) -> float:
    """A timeout option's seconds (a click callback): FloatRange(min=1) let through NaN (no comparison is true of
    it), and inf or 1e10, which crashed the wait for a child process (exit 3) where a bad value is exit 2."""
    if not (1 <= value <= MAX_TIMEOUT_S):  # false for NaN too
        raise click.BadParameter(f"{value} is not a number of seconds from 1 to {MAX_TIMEOUT_S:.0f} (a week)",
                                 context, param)
    return value


def plot_output(path: Path | None) -> None:
    """--plot checked before any run: a writable path, and matplotlib to draw with."""
    writable_output(path, "--plot")
    if path is None:
        return
    try:
        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError("matplotlib")
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise OutputError("--plot needs matplotlib; install it with pip install 'evalrun[plot]', or drop --plot") from None
    formats = set(FigureCanvasBase.get_supported_filetypes())  # what savefig writes, by file name ending
    from matplotlib import rcParams
    import shutil

    if shutil.which(rcParams["pgf.texsystem"]) is None:  # .pgf measures its text with LaTeX
        formats.discard("pgf")
    if path.suffix.lstrip(".").lower() not in formats:
        raise OutputError(f"--plot {path} does not end in a format matplotlib writes here; end it in one of "
                          f"{', '.join('.' + name for name in sorted(formats))}"
                          f"{' (.pgf needs ' + rcParams['pgf.texsystem'] + ')' if 'pgf' not in formats else ''}")


def _try_opening_for_writing(path: Path, what: str) -> None:
    """Open `path` for writing as the command will, neither truncating nor keeping a file it made: a folder's
    permissions do not tell a dangling link, a read-only file or a file system that refuses new files
    (/proc), which failed only after the whole run. A pipe is refused: the report is written after the run,
    and opening it now would end its reader (or wait for one). Safe when processes (torchrun's ranks) check
    one path at once: a new file is made exclusively, and only by the process that removes it."""
    target = Path(os.path.realpath(path))  # a link's target, where the write will land
    try:
        if target.exists():
            mode = target.stat().st_mode
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                raise OutputError(f"{what} {path} is a pipe or a socket; the report is written after the run: pass "
                                  "a file path")
            if not target.is_file():  # a device such as /dev/null: opening it changes nothing
                if not os.access(target, os.W_OK):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
                return
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
            return
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:  # made this instant by another process checking the same path: the folder takes files
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    except OSError as error:
        raise OutputError(f"{what} {path}: cannot write there ({error.strerror}); pass another path") from None


def _is_sqlite_file(path: Path) -> bool:
    if not path.is_file():  # reading a FIFO would wait for a writer
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


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
@shard_option
@store_option
@click.option("--label", help="A note stored with the run.")
@output_options("text", "json")
@quiet_option
def run(store_path, label, output_format, as_json, quiet, shard_text, **kwargs) -> None:
    """Run the prompt set, capture every step's logits, store the run.

    Under `torchrun --nproc-per-node N -m evalrun run ...` the ranks split the prompt set (rank 0 stores
    one run), or the model with --tensor-parallel N.

    \b
    Example:
      evalrun run --model random:tiny --prompts smoke --max-new-tokens 8 --json
      torchrun --nproc-per-node 2 -m evalrun run --model random:tiny --tensor-parallel 2
    """
    from .config import is_server_engine
    from .server_run import execute_server_run
    from .sharding import execute_sharded_run

    config, shard = config_from(kwargs), parsed_shard(shard_text)
    store = _store_once_input_is_good(store_path) if leader() else None
    if is_server_engine(config.engine):  # a server computes: one process, no shards
        if shard is not None:
            raise click.UsageError("--shard splits evalrun's own runs; a server runs whole")
        outcome = execute_server_run(config, store, label=label, progress_factory=progress_factory(quiet))
    else:
        outcome = execute_sharded_run(config, store, label=label, progress_factory=progress_factory(quiet),
                                      shard=shard)
    if not leader():
        return
    if chosen_format(output_format, as_json) == "json":
        emit(report.to_json(report.run_json(outcome)))
    else:
        emit(report.run_text(outcome))


@cli.command()
@run_options
@output_options("text", "json")
def fingerprint(output_format, as_json, **kwargs) -> None:
    """Show the effective config, environment, model identity and prompt-set hash.

    \b
    Example:
      evalrun fingerprint --model random:tiny --prompts smoke --json
    """
    from .config import is_server_engine
    from .runner import prepare
    from .server_run import prepare_server

    config = config_from(kwargs)
    header = (prepare_server(config) if is_server_engine(config.engine) else prepare(config)).header
    json_out = chosen_format(output_format, as_json) == "json"
    emit(report.to_json(header) if json_out else report.fingerprint_text(header))


@cli.group()
def store() -> None:
    """List, show and check stored runs.

    \b
    Example:
      evalrun store ls
    """


MAX_LISTED_RUNS = 1_000_000_000  # SQLite's LIMIT is a 64-bit integer: a larger --limit is the flag's fault


@store.command("ls")
@store_option
@click.option("--limit", type=click.IntRange(min=1, max=MAX_LISTED_RUNS), default=50, show_default=True,
              help="Newest runs to list.")
@output_options("text", "json")
def store_ls(store_path, limit, output_format, as_json) -> None:
    """List runs, newest first.

    \b
    Example:
      evalrun store ls --limit 10 --json
    """
    runs = open_store(store_path, readonly=True).list_runs(limit)
    json_out = chosen_format(output_format, as_json) == "json"
    emit(report.to_json([r.summary() for r in runs]) if json_out else report.runs_table(runs))


@store.command("show")
@click.argument("run_id")
@store_option
@output_options("text", "json")
def store_show(run_id, store_path, output_format, as_json) -> None:
    """Show one run by id or unique prefix.

    \b
    Example:
      evalrun store show 3f2a
    """
    db = open_store(store_path, readonly=True)
    record = db.get_run(run_id)
    results = db.load_results(record.id, names=("tokens", "margins"))
    json_out = chosen_format(output_format, as_json) == "json"
    emit(report.to_json(report.run_record_json(record, results)) if json_out
         else report.run_record_text(record, results))


@store.command("check")
@store_option
@output_options("text", "json")
def store_check(store_path, output_format, as_json) -> None:
    """Check the store: SQLite integrity, schema, orphans, incomplete runs, every run and result row as the readers
    parse it, array bytes against their digests. A problem exits 2 (the store is damaged: the report on stdout
    lists each, stderr names the first); exit 1 is a verdict's alone.

    \b
    Example:
      evalrun store check --store store/evalrun.db
    """
    outcome = check_store(open_store(store_path, readonly=True, require_schema=False))
    json_out = chosen_format(output_format, as_json) == "json"
    emit(report.to_json(outcome) if json_out else report.store_check_text(outcome))
    if not outcome["ok"]:
        raise Exit(EXIT_UNUSABLE, _damaged_store_line(outcome))


@store.command("merge")
@click.argument("out_path", metavar="OUT.db", type=click.Path(path_type=Path))
@click.argument("sources", metavar="A.db B.db ...", nargs=-1, required=True, type=click.Path(path_type=Path))
@output_options("text", "json")
def store_merge(out_path, sources, output_format, as_json) -> None:
    """Merge the runs of several stores into OUT (idempotent; each source must pass `store check`).

    \b
    Example:
      evalrun store merge all.db shard0.db shard1.db
    """
    from .store_merge import merge_stores

    outcome = merge_stores(out_path, list(sources))
    if chosen_format(output_format, as_json) == "json":
        emit(report.to_json(outcome))
    else:
        emit("\n".join(f"{entry['store']}: {entry['copied']} runs copied, {entry['already_there']} already there"
                       for entry in outcome["sources"]))
        emit(report.store_check_text(outcome["check"]))
    if not outcome["check"]["ok"]:
        raise Exit(EXIT_UNUSABLE, _damaged_store_line(outcome["check"]))


def _damaged_store_line(outcome: dict[str, Any]) -> str:
    problems = outcome["problems"]
    more = f" (and {len(problems) - 1} more, listed on stdout)" if len(problems) > 1 else ""
    return (f"evalrun: error: store {outcome['path']} is damaged: {problems[0] if problems else 'see stdout'}{more}; "
            "restore it from a copy, or write new runs to another --store")


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
@output_options("text", "json")
@quiet_option
def golden_create(name, directory, force, output_format, as_json, quiet, **kwargs) -> None:
    """Run the pinned config, the oracle and the known-good implementations; write golden/NAME.db.

    \b
    Example:
      evalrun golden create smollm2-cpu --config debug
    """
    from .config import is_server_engine
    from .golden import create_golden
    from .server_golden import create_server_golden

    config = config_from(kwargs)
    create = create_server_golden if is_server_engine(config.engine) else create_golden
    created = create(name, config, directory, force, phase_progress(quiet or not leader()))
    if created is None:
        return
    summary = created.summary()
    json_out = chosen_format(output_format, as_json) == "json"
    emit(report.to_json(summary) if json_out else report.golden_created_text(summary))


@golden.command("verify")
@click.argument("name")
@run_options
@dir_option
@click.option("--strict", is_flag=True, help="Drift fails too (exit 1).")
@output_options("text", "json", "markdown")
@click.option("--junit", "junit_path", type=click.Path(path_type=Path), help="Also write a JUnit XML report here.")
@shard_option
@store_option
@click.option("--from-shards", is_flag=True, help="Judge from the --shard jobs' runs in --store (after `store merge`); "
                                                  "runs no model.")
@quiet_option
def golden_verify(name, directory, strict, output_format, as_json, junit_path, shard_text, store_path, from_shards,
                  quiet, **kwargs) -> None:
    """Verify a candidate config against a golden: identical, drift, changed or incomparable.

    Exit 0 identical or drift (1 with --strict), 1 changed, 2 incomparable or cannot compare. Under
    torchrun the ranks split the prompts (or the model, --tensor-parallel N) and rank 0 reports.

    \b
    Example:
      evalrun golden verify smollm2-cpu -O3 --format markdown > comment.md
      evalrun golden verify smollm2-cpu --store runs.db --json   # keeps the candidate run: candidate_run
      evalrun golden verify smollm2-cpu --shard 0/2 --store s0.db     # then --shard 1/2 --store s1.db
      evalrun store merge all.db s0.db s1.db && evalrun golden verify smollm2-cpu --store all.db --from-shards
    """
    from . import verdict_report
    from .config import is_server_engine
    from .distributed import broadcast_int
    from .golden import open_golden
    from .server_verify import verify_with_server
    from .sharding import ShardStored, verify_sharded
    from .verify import candidate_config

    writable_output(junit_path, "--junit", store_path,  # nor the files it reads (--prompts, --config)
                    *(Path(kwargs[key]) for key in ("prompts", "config_source") if kwargs.get(key)))
    opened, shard = open_golden(name, directory), parsed_shard(shard_text)
    if from_shards and shard is not None:
        raise click.UsageError("--from-shards judges the stored shards; drop --shard")
    if junit_path and shard is not None and not shard.whole:
        raise click.UsageError("a --shard job stores its runs and gives no verdict; pass --junit to the "
                               "--from-shards verify that judges them")
    candidate = candidate_config(opened, *run_flags(kwargs))
    if is_server_engine(candidate.engine):  # a server computes: one process, no shards (server_verify)
        if shard is not None or from_shards:
            raise click.UsageError("--shard and --from-shards split evalrun's own runs; a server runs whole")
        outcome = verify_with_server(opened, candidate, strict, phase_progress(quiet))
    else:
        stored = from_shards or (shard is not None and not shard.whole)
        store = open_store(store_path, readonly=from_shards) if stored and leader() else None
        keep = _kept_candidate(store_path, stored, candidate, name)  # a whole verify with --store keeps its candidate
        outcome = verify_sharded(opened, candidate, strict, phase_progress(quiet or not leader()), shard, store,
                                 from_shards, keep.observe if keep else None)
        if keep and keep.run_id and outcome is not None and not isinstance(outcome, ShardStored):
            outcome = dataclasses.replace(outcome, candidate_run={"run_id": keep.run_id, "store": str(keep.path)})
    chosen = chosen_format(output_format, as_json)
    if isinstance(outcome, ShardStored):
        stored = f"{outcome.prompts} prompts run, stored in {outcome.store}"
        emit(report.to_json(outcome.as_dict()) if chosen == "json" else
             f"### evalrun golden {report.markdown_cell(name)} shard {outcome.shard}: "
             f"{report.markdown_cell(stored)}\n\nnext: {report.markdown_cell(outcome.next_steps)}"
             if chosen == "markdown" else
             f"golden {name} shard {outcome.shard}: {stored}\nnext: {outcome.next_steps}")
        return
    code = broadcast_int(outcome.exit_code if outcome is not None else 0)  # every rank exits as rank 0 does
    if outcome is None:
        if code:
            raise Exit(code)
        return
    verdict = outcome
    emit(verdict_report.render(verdict, chosen))
    unwritten = _github_outputs(verdict, name, chosen)
    if junit_path:
        try:
            junit_path.write_text(verdict_report.junit(verdict, strict))
        except OSError as error:
            unwritten.append(f"--junit {junit_path} ({error.strerror})")
    missing = f"could not write {'; '.join(unwritten)}" if unwritten else ""
    if missing and not verdict.exit_code:  # the verdict stands: its exit code when it has one, else 2
        raise OutputError(f"golden {name}: {verdict.verdict}, but {missing}; pass a writable path")
    if missing and verdict.exit_code != EXIT_UNUSABLE:
        click.echo(f"evalrun: warning: golden {name}: {verdict.verdict}, but {missing}", err=True)
    if verdict.exit_code:  # exit 2 says it in its one line
        raise Exit(verdict.exit_code, f"evalrun: golden {name}: {verdict.verdict}: {verdict.causes[0]}"
                   f"{f' (and {missing})' if missing else ''}" if verdict.exit_code == EXIT_UNUSABLE else None)


def _kept_candidate(store_path: Path | None, stored: bool, candidate, name: str):
    """`golden verify --store PATH` without shards keeps the candidate run (runner.KeptCandidate)."""
    from .distributed import world
    from .runner import KeptCandidate

    if store_path is None or stored:
        return None
    if world().distributed and candidate.tensor_parallel == 1:
        raise click.UsageError("--store keeps a whole verify's candidate run; torchrun ranks split this one: "
                               "use --shard I/N jobs with --store, or drop --store")
    return KeptCandidate(store_path, f"verify:{name}") if leader() else None


def _github_outputs(verdict, name: str, output_format: str) -> list[str]:
    """On GitHub Actions: the Markdown verdict in the step summary, an annotation for drift/changed (text only:
    stdout stays one JSON or Markdown document otherwise). Returns what could not be written."""
    from . import ci_output, verdict_report

    unwritten = []
    try:
        ci_output.append_step_summary(verdict_report.markdown(verdict))
    except OSError as error:
        unwritten.append(f"GITHUB_STEP_SUMMARY {ci_output.step_summary_path()} ({error.strerror})")
    if ci_output.on_github_actions() and output_format == "text":
        line = ci_output.annotation(verdict.verdict, f"evalrun golden {name}",
                                    f"{verdict.verdict}: {verdict.causes[0] if verdict.causes else ''}")
        if line:
            emit(line)
    return unwritten


@golden.command("list")
@dir_option
@output_options("text", "json")
def golden_list(directory, output_format, as_json) -> None:
    """List the goldens in the folder (a damaged one is listed with its problem).

    \b
    Example:
      evalrun golden list --json
    """
    from .golden import list_goldens

    entries = list_goldens(directory)
    json_out = chosen_format(output_format, as_json) == "json"
    emit(report.to_json(entries) if json_out else report.goldens_table(entries))


@golden.command("show")
@click.argument("name")
@dir_option
@output_options("text", "json")
def golden_show(name, directory, output_format, as_json) -> None:
    """Show a golden: its fingerprints, config and pinned outputs.

    \b
    Example:
      evalrun golden show smollm2-cpu
    """
    from .golden import open_golden

    opened = open_golden(name, directory)
    json_out = chosen_format(output_format, as_json) == "json"
    results = opened.results("pinned")
    emit(report.to_json(report.golden_json(opened, results)) if json_out
         else report.golden_text(opened, results))


@cli.command()
@click.argument("run_a")
@click.argument("run_b")
@store_option
@click.option("--golden-dir", type=click.Path(path_type=Path), default=Path("golden"), show_default=True,
              help="Folder of goldens for golden:NAME.")
@click.option("--prompt", "prompt_ids", multiple=True, metavar="ID", help="Only these prompts (repeatable).")
@output_options("text", "json", "markdown")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG of per-step error.")
def diff(run_a, run_b, store_path, golden_dir, prompt_ids, output_format, as_json, plot_path) -> None:
    """Explain the bit differences between two runs (ids, unique prefixes, or golden:NAME).

    \b
    Example:
      evalrun diff golden:smollm2-cpu 9c1e --format markdown
    """
    from . import diff_report
    from .diff import diff_refs
    from .models import decoder_for

    plot_output(plot_path)
    result = diff_refs(run_a, run_b, store_path or default_store_path(), golden_dir, tuple(prompt_ids), decoder_for)
    emit(diff_report.render(result, chosen_format(output_format, as_json)))
    if not result.prompts:  # the report shows how the runs differ; no prompt's outputs could be compared
        raise Exit(EXIT_UNUSABLE, f"evalrun: error: no prompt of {result.a} and {result.b} is comparable (in one run "
                                  f"only, or other input tokens: {', '.join(result.not_comparable)}); diff runs of one "
                                  "prompt set, or pass --prompt with an id both ran alike")
    if plot_path:
        diff_report.plot(result, plot_path)


@cli.command()
@run_options
@store_option
@click.option("--batch-sizes", default="1,4,16", show_default=True, metavar="N,N,...",
              help="Batch sizes to place each prompt in (1, alone, is always run: the reference).")
@click.option("--positions", default="first,middle,last", show_default=True, metavar="first,middle,last",
              help="Rows of each batch the prompt is placed at.")
@click.option("--repeats", type=click.IntRange(min=1, max=100), default=2, show_default=True,
              help="Runs of each cell (run-to-run determinism).")
@output_options("text", "json", "markdown")
@quiet_option
def invariance(store_path, batch_sizes, positions, repeats, output_format, as_json, quiet, **kwargs) -> None:
    """Run each prompt alone and inside batches at several positions, N times each; report what varies.

    Every run is stored (`evalrun diff` works between them). Exit 0 whatever is measured.

    \b
    Example:
      evalrun invariance --model random:tiny --prompts smoke --batch-sizes 1,4,16 --repeats 2
      evalrun invariance --set batch_invariant=true --format markdown
    """
    from .invariance import check_request, measure_invariance, parse_batch_sizes, parse_positions
    from .invariance_report import invariance_markdown, invariance_text

    if kwargs.get("batch_size") is not None:  # the report named it as the batch size, and no run used it
        raise click.UsageError("invariance runs each batch size of --batch-sizes and reads no --batch-size; "
                               "drop it (--batch-sizes 1,4,16 names the sizes)")
    config = config_from(kwargs)
    sizes, places = parse_batch_sizes(batch_sizes), parse_positions(positions)
    check_request(config, sizes, places, repeats)  # before the store is opened (or made)
    outcome = measure_invariance(config, sizes, places, repeats, _store_once_input_is_good(store_path),
                                 phase_progress(quiet))
    chosen = chosen_format(output_format, as_json)
    if chosen == "json":
        emit(report.to_json(outcome.as_dict()))
    else:
        emit(invariance_markdown(outcome) if chosen == "markdown" else invariance_text(outcome))


@cli.command()
@click.option("--model", help="Model reference (default smollm2-135m).")
@click.option("--prompts", metavar="FILE.jsonl", help="Prompt set.")
@click.option("--dtype", metavar="T", help="float32|bfloat16|float16.")
@click.option("--device", metavar="D", help="auto|cpu|cuda[:N].")
@click.option("--max-new-tokens", type=click.IntRange(min=1), help="Tokens per prompt.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Prompts per batch.")
@click.option("--matrix", "matrix_names", metavar="NAMES", default=None,
              help="Comma-separated configs: O0..O3, none, stock, trace-once, piecewise, each optionally @ENGINE "
                   "(O2@transformers) and +KEY=VALUE knobs (O2+linear_kernel=triton-gemv) (default: O0..O3 on GPU, "
                   "the compilation modes on CPU).")
@click.option("--no-baselines", is_flag=True, help="Skip transformers' generate baselines.")
@click.option("--config-timeout", type=click.FloatRange(min=1), default=3600, show_default=True, metavar="SECONDS",
              callback=timeout_seconds,
              help="Stop a configuration that runs longer (its row shows the timeout; at most a week); the others "
                   "still run.")
@click.option("--repeats", type=click.IntRange(min=1, max=100), default=1, show_default=True,
              help="Run the whole matrix this many times, in rounds; each row shows the medians of its runs and its "
                   "tokens/s spread.")
@click.option("--compare", "baseline_path", type=click.Path(path_type=Path), metavar="BASELINE.json",
              help="An earlier `evalrun bench --json` output: print each config's change against it.")
@click.option("--fail-on", "fail_on", multiple=True, metavar="METRIC:PCT",
              help="With --compare: exit 1 when METRIC is worse than the baseline by more than PCT percent, e.g. "
                   "tokens_per_s:5% (repeatable).")
@quiet_option
@output_options("text", "json")
def bench(model, prompts, dtype, device, max_new_tokens, batch_size, matrix_names, no_baselines, config_timeout,
          repeats, baseline_path, fail_on, quiet, output_format, as_json) -> None:
    """Measure a matrix of configurations side by side, each in a fresh process, with transformers baselines.

    With --compare and --fail-on, a performance regression exits 1, like a changed verdict.

    \b
    Example:
      evalrun bench --model random:llama3-8b --dtype bfloat16 --max-new-tokens 128 --prompts smoke
      evalrun bench --matrix O0,O2 --compare baseline.json --fail-on tokens_per_s:5% --fail-on ttft_ms:10%
      evalrun bench --matrix O0,O2,O0@transformers,O2@transformers --model random:llama3-8b --dtype bfloat16
      evalrun bench --matrix O2,O2+blas_library=cublaslt,O2+linear_kernel=triton-gemv --no-baselines
      evalrun bench --matrix O0,O0+linear_kernel=gguf-gemv --repeats 3   # medians of three rounds, and the spread
    """
    from . import bench_compare
    from .bench import BASELINES, BenchRequest, run_bench

    if fail_on and baseline_path is None:
        raise click.UsageError("--fail-on needs --compare BASELINE.json (an earlier `evalrun bench --json`)")
    rules = [bench_compare.parse_fail_on(text) for text in fail_on]
    baseline = bench_compare.load_baseline(baseline_path) if baseline_path else None
    request = BenchRequest(model, prompts, dtype, device, max_new_tokens, batch_size, matrix_names,
                           () if no_baselines else BASELINES, config_timeout, repeats)
    _check_bench_inputs(request)
    rows = run_bench(request, (lambda name: None) if quiet
                     else (lambda name: click.echo(f"bench: {report.printable(name)}", err=True)))
    changes = bench_compare.compare(rows, baseline, rules) if baseline is not None else None
    if chosen_format(output_format, as_json) == "json":
        emit(report.to_json(rows if changes is None else {"rows": rows,
                                                          "comparison": bench_compare.as_dicts(changes)}))
    else:
        emit(report.bench_table(rows))
        if changes is not None:
            emit(f"\nagainst {baseline_path}:\n" + report.table(*bench_compare.table(changes)))
    failed = [row for row in rows if row.get("error")]
    if failed:
        raise Exit(EXIT_UNUSABLE, f"evalrun: error: {len(failed)} of {len(rows)} bench configurations failed "
                                  f"({', '.join(row['config'] for row in failed)}); their rows say why, the first: "
                                  f"{failed[0]['error'].removeprefix('evalrun: error: ')}")
    other = bench_compare.other_workloads(changes or [])
    if other:
        raise Exit(EXIT_UNUSABLE, f"evalrun: error: --compare {baseline_path} measured config {other[0].config!r} on "
                                  f"another workload ({', '.join(other[0].differs)} differ): a ratio of two workloads "
                                  "says nothing of the config; compare a bench of the same model, prompts, tokens, "
                                  "dtype, device and batch size")
    if changes is not None and bench_compare.compared_nothing(changes, rules):
        measured = ", ".join(row["config"] for row in rows)[:200]
        raise Exit(EXIT_UNUSABLE, f"evalrun: error: --fail-on compared nothing: {baseline_path} has no figure of "
                                  f"{', '.join(sorted({rule.metric for rule in rules}))} for the configs measured now "
                                  f"({measured}); pass --compare a bench --json of these configs")
    worse = bench_compare.regressions(changes or [])
    if worse:
        raise Exit(EXIT_CHANGED, "evalrun: bench: " + "; ".join(
            f"{c.config} {c.metric} {c.change_percent:+.1f}% (allowed -{c.limit_percent:g}%)" for c in worse))


def _check_bench_inputs(request) -> None:
    """Each configuration's run options and the prompt file, checked here first: a bad value (a max_new_tokens out
    of range, a duplicate prompt id) failed in every configuration's process, and the one line said only that
    configurations failed."""
    from .prompts import read_records, resolve_path

    config = None
    for name, options in request.matrix(request.on_gpu()):
        try:
            with run.make_context("run", [*request.common_options(), *options]) as context:
                config = config_from(dict(context.params))
        except (EvalrunError, click.exceptions.ClickException) as error:
            text = error.format_message() if isinstance(error, click.exceptions.ClickException) else str(error)
            raise ConfigError(f"bench config {name}: {text}") from None
    if config is not None:
        read_records(resolve_path(config.prompts))


@cli.command()
@click.option("--good", "good_spec", required=True, metavar="SPEC",
              help="Items, comma-separated, applied in order: O0-O3, a preset, FILE.toml, KEY=VALUE, run:ID, "
                   "golden:NAME.")
@click.option("--bad", "bad_spec", required=True, metavar="SPEC", help="The same kinds of items as --good.")
@click.option("--until", default="bits", show_default=True, metavar='bits|verdict|cmd:"..."',
              help="bits: any logits digest changes; verdict: the golden's verdict turns changed; cmd: a shell "
                   "command, exit 0 good, 125 skip (it sees EVALRUN_BISECT_CONFIG, EVALRUN_BISECT_RUN).")
@click.option("--golden", "golden_name", metavar="NAME",
              help="Golden for --until verdict (default: a golden:NAME item).")
@click.option("--golden-dir", type=click.Path(path_type=Path), default=Path("golden"), show_default=True,
              help="Folder of goldens.")
@run_options
@store_option
@click.option("--skip", "skipped", multiple=True, type=click.Choice(["compiler", "layer"]),
              help="Leave out stage 2 (compiler) or 3 (layer) (repeatable).")
@click.option("--in-process", is_flag=True, help="Run probes in this process instead of a fresh one each (faster; "
                                                 "compiled state may carry from one probe to the next).")
@click.option("--probe-timeout", type=click.FloatRange(min=1), default=3600, show_default=True, metavar="SECONDS",
              callback=timeout_seconds,
              help="Stop a probe's process, or a cmd: predicate, that runs longer (it counts as skipped; at most "
                   "a week; with --in-process, the cmd: predicate's only).")
@click.option("--compare-compiler-bisector", "compare", is_flag=True,
              help="Also run torch's CompilerBisector alone on BAD (its reference: BAD under the eager backend) "
                   "and print its calls and answer beside evalrun's.")
@output_options("text", "json", "markdown")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG of per-layer error.")
@quiet_option
def bisect(good_spec, bad_spec, until, golden_name, golden_dir, store_path, skipped, in_process, probe_timeout,
           compare, output_format, as_json, plot_path, quiet, **kwargs) -> None:
    """Find the knob, compiler pass, layer and step that turn GOOD into BAD.

    Probes are ordinary stored runs (labelled bisect:SESSION probe N); a second bisect on the same store
    reuses them. Exit 0 when a culprit is found or GOOD and BAD do not differ; 2 on bad input, or when GOOD
    or BAD cannot be run or judged (a failed, timed-out or skipped probe of either).

    \b
    Example:
      evalrun bisect --good O0 --bad O3 --until bits
      evalrun bisect --good golden:smollm2-cpu --bad O2 --until verdict --format markdown
    """
    from . import bisect_report
    from .bisect import STAGES, BisectRequest, run_bisect
    from .bisect_search import parse_until

    plot_output(plot_path)
    if plot_path and "layer" in skipped:
        raise click.UsageError("--plot draws stage 3's per-layer errors; drop --skip layer or --plot")
    kind, _ = parse_until(until)  # an invalid --until first: the checks below read its kind
    if golden_name is not None and kind != "verdict":  # it was never read
        raise click.UsageError(f"--golden names the golden of --until verdict, and --until {until} reads none; "
                               "drop --golden or pass --until verdict")
    given = click.get_current_context().get_parameter_source("probe_timeout")
    if in_process and given is click.core.ParameterSource.COMMANDLINE and kind != "cmd":
        raise click.UsageError("--probe-timeout stops a probe's own process (and a cmd: predicate's), and "
                               "--in-process runs every probe in this one; drop one of them")
    config_source, flags, sets = run_flags(kwargs)
    request = BisectRequest(good_spec, bad_spec, until, golden_name, golden_dir, config_source, flags, sets, store_path,
                            in_process, stages=tuple(s for s in STAGES if s not in skipped),
                            probe_timeout=probe_timeout, compare_compiler_bisector=compare,
                            progress=None if quiet else (lambda line: click.echo(f"bisect: {line}", err=True)))
    result = run_bisect(request)
    emit(bisect_report.render(result, chosen_format(output_format, as_json)))
    if plot_path and result.layer is not None and result.layer.points:
        bisect_report.plot(result, plot_path)
    elif plot_path:  # the report stands (a culprit exits 0): why there is no plot is a warning
        why = ("there is no culprit to look into" if result.layer is None else
               f"the layer stage has no per-layer errors ({result.layer.summary})")
        click.echo(f"bisect: no plot written to {plot_path}: {report.printable(why)}", err=True)


# ---------------------------------------------------------------- the one place errors become exit codes

ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EDQUOT, errno.EISDIR,
                      errno.ENOTDIR)
FIX_BY_ERRNO = {errno.ENOSPC: "free space", errno.EDQUOT: "free space",  # the rest: choose a writable path
                errno.ENOENT: "check the path (a file it names, or the folder it is written in, does not exist)",
                errno.ENOTDIR: "check the path (a part of it that should be a folder is a file)",
                errno.EISDIR: "check the path (it names a folder where a file belongs)"}


def one_line(text: str, limit: int = 600) -> str:
    """Any message as one printable line: line breaks and control characters (which a damaged file can
    put into a prompt id or a name) are shown as escapes, so stderr stays one line. Past `limit` characters
    its middle gives way ("…"), never its end: a message names the problem first and the fix last, and what
    makes one long is a value inside it (a deep path, a forged prompt id), as a golden under a long CI path
    lost its `--force` when the end was cut."""
    flat = report.printable(text)
    if len(flat) <= limit:
        return flat
    tail = limit * 3 // 5  # the fix, and the end of the problem
    return flat[: limit - tail - 1] + "…" + flat[-tail:]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return one_line(text[0], 500) if text else type(error).__name__


def _crash(error: BaseException) -> int:
    """An unexpected exception: the traceback goes to a file, one line names it, exit 3."""
    handle, path = tempfile.mkstemp(prefix="evalrun-crash-", suffix=".txt")
    with os.fdopen(handle, "w") as file:
        file.write("".join(traceback.format_exception(error)))
    _say(f"evalrun: internal error: {type(error).__name__}: {_first_line(error)} (traceback in {path}; "
         "please report it)")
    return EXIT_INTERNAL


_last_said: str | None = None  # the line said on stderr: under --json an error's line is also a JSON object on stdout


def _say(text: str) -> None:
    global _last_said
    _last_said = one_line(text)
    with contextlib.suppress(OSError):  # a closed stderr: the exit code still says it
        click.echo(_last_said, err=True)


def exit_code_of(error: BaseException) -> int:
    """Map an exception to its exit code, printing its one line (never a traceback) on stderr."""
    if isinstance(error, Exit):
        if error.message:
            _say(error.message)
        return error.code
    if isinstance(error, EvalrunError):
        _say(f"evalrun: error: {_first_line(error)}")
        return EXIT_UNUSABLE
    if isinstance(error, click.exceptions.Abort | KeyboardInterrupt):
        _say(f"evalrun: interrupted{': ' + _first_line(error) if str(error) else ''}; run the command again (a run "
             "it had begun is stored as interrupted)")
        return EXIT_UNUSABLE
    if isinstance(error, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # `evalrun golden`: the help, on stdout
        emit(error.ctx.get_help())
        _say(f"evalrun: error: no command given; choose one of those listed above ({error.ctx.command_path} --help)")
        return EXIT_UNUSABLE
    if isinstance(error, click.exceptions.ClickException):
        _say(f"evalrun: error: {error.format_message()}; see evalrun --help")
        return EXIT_UNUSABLE
    if isinstance(error, OSError) and error.errno == errno.EPIPE:  # stderr, or a child's pipe, closed early
        _say("evalrun: error: an output stream was closed before the command finished (broken pipe); let the reader "
             "read to the end")
        return EXIT_UNUSABLE
    if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
        where = f" ({error.filename})" if error.filename else ""
        _say(f"evalrun: error: {error.strerror}{where}; {FIX_BY_ERRNO.get(error.errno, 'choose a writable path')}")
        return EXIT_UNUSABLE
    if isinstance(error, sqlite3.OperationalError) and any(
            text in str(error) for text in ("disk is full", "readonly", "unable to open", "locked")):
        _say(f"evalrun: error: the store cannot be written ({_first_line(error)}); free space or pass a "
             "writable --store")
        return EXIT_UNUSABLE
    if isinstance(error, sqlite3.DatabaseError):  # evalrun's SQL is fixed and parameterized: the file is at fault
        _say(f"evalrun: error: a store or golden file is damaged or not evalrun's ({_first_line(error)}); "
             "check it with `evalrun store check` or restore it")
        return EXIT_UNUSABLE
    if isinstance(error, UnicodeError):  # evalrun writes UTF-8 only: text that is not came from a damaged file
        _say(f"evalrun: error: a file holds text that is not valid UTF-8 ({_first_line(error)}); restore or "
             "re-create it")
        return EXIT_UNUSABLE
    if isinstance(error, MemoryError):
        _say("evalrun: error: out of memory; use a smaller model, batch or --max-new-tokens")
        return EXIT_UNUSABLE
    if isinstance(error, RecursionError):
        _say("evalrun: error: an input is nested too deeply to read (a damaged or hostile file); check the "
             "files this command reads")
        return EXIT_UNUSABLE
    return _crash(error)


def _stop_on_sigterm():
    """SIGTERM raises Terminated (as Ctrl-C raises KeyboardInterrupt) unless something else handles it;
    returns the handler to restore, or None where none was installed (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None

    def terminated(signum, frame):
        raise Terminated(f"stopped by signal {signum} (SIGTERM)")

    signal.signal(signal.SIGTERM, terminated)
    return previous


def main(argv: list[str] | None = None) -> None:
    """Entry point: click in non-standalone mode, so every outcome passes through `exit_code_of`."""
    for stream in (sys.stdout, sys.stderr):  # text from a damaged file must never fail to print
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    from .distributed import leave
    from .store import close_open_stores, open_stores

    global _output_printed, _last_said
    code, already_open, _output_printed, _last_said = 0, open_stores(), False, None
    words = list(sys.argv[1:] if argv is None else argv)
    previous = _stop_on_sigterm()
    try:  # click's own main would turn a closed pipe into exit 1 and Ctrl-C or SIGTERM into a bare Abort
        if argv is None:  # a shell asking for completions (_EVALRUN_COMPLETE=bash_source evalrun) is answered, as
            cli._main_shell_completion({}, "evalrun", None)  # click's main does first (it exits there)
        with cli.make_context("evalrun", list(words)) as context:
            cli.invoke(context)
    except click.exceptions.Exit as done:  # --help
        code = done.exit_code
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the one place errors become exit codes
        code = exit_code_of(error)
        if not isinstance(error, Exit) and not _output_printed and json_requested(words) and _leader_or_unknown():
            with contextlib.suppress(OSError):  # a closed stdout: the stderr line stands alone
                emit(report.to_json({"error": _last_said or type(error).__name__, "exit_code": code}))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    try:
        close_open_stores(keep=already_open)  # every run in its .db file (a torchrun rank may end by os._exit)
        leave(code)  # under torchrun: leave the process group so the launcher sees a clean exit
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the command's outcome stands if it failed
        code = code or exit_code_of(error)
    sys.exit(code)
