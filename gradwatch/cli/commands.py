"""The ``gradwatch`` command: argument parsing and dispatch of ``demo``, ``report``, ``validate`` and ``bench``.

Exit codes (every command): 0 fine; 1 alerts found where the command was
asked to fail on them (``--fail-on-alerts``, or ``raise_on`` stopping the
demo); 2 usage errors (bad flags, an invalid config, no run to report);
130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import yaml

from gradwatch._version import __version__
from gradwatch.cli.console import plural, unicode_ok
from gradwatch.config import GradWatchConfig, config_keys, config_problems, load_config, option_names, options_table, show_value
from gradwatch.errors import ConfigError, GradWatchError
from gradwatch.io import not_judged

EXIT_OK, EXIT_ALERTS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

EXIT_CODES_TEXT = """exit codes:
  0    fine
  1    alerts found and the command was asked to fail on them{extra}
  2    usage error: bad flag or value, invalid config, nothing readable"""

#: Options that the demo handles with its own flags (``--seed``, ``--log-dir``).
_DEMO_OWN_OPTIONS = ("seed", "log_dir")


def _flag(name: str) -> str:
    """``overhead_budget`` -> ``--overhead-budget`` (one name everywhere)."""
    return "--" + name.replace("_", "-")


def _fail(command: str, message: str) -> int:
    print(f"gradwatch {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _yaml_value(text: str) -> Any:
    """A flag value read as YAML (``5``, ``auto``, ``1e-4``, ``[fc1.*]``, ``{l2: 1e-4}``, ``null``, ``true``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


# --------------------------------------------------------------------- parser

def build_parser(with_bench: bool = False) -> argparse.ArgumentParser:
    """The ``gradwatch`` argument parser (``with_bench``: let :mod:`gradwatch.cli.bench` add its flags)."""
    parser = argparse.ArgumentParser(
        prog="gradwatch",
        formatter_class=_Formatter,
        description="Verify backprop gradients during training: sampled two-sided numerical checks,\n"
        "per-tensor trends and drift alerts in TensorBoard and checks.jsonl.",
        epilog=EXIT_CODES_TEXT.format(extra="") + "\n\nRun 'gradwatch COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"gradwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_report(sub)
    _add_validate(sub)
    _add_bench(sub, with_bench)
    return parser


def _add_demo(sub: Any) -> None:
    from gradwatch.cli.demo import BUGS, DEMO_OPTIONS, LATE_THRESHOLD, SCALE_FACTOR, DemoSettings

    defaults = DemoSettings()
    p = sub.add_parser(
        "demo",
        formatter_class=_Formatter,
        help="train a small network with a buggy custom activation and watch GradWatch catch it",
        description=(
            "Train a small classifier on 3-class 2-D spirals (generated, no download) with BatchNorm,\n"
            "dropout, an L2 term in the loss and SGD weight decay, under GradWatch. Its first activation\n"
            "is a custom autograd.Function (SiLU) whose backward has the bug chosen by --bug:\n"
            f"  late   right for |x| < {LATE_THRESHOLD:g}, wrong beyond; half-way through, the first layer's weights\n"
            f"         are scaled x{defaults.grow_factor:g} (\"weights grow\") and its inputs cross {LATE_THRESHOLD:g}\n"
            f"  scale  {SCALE_FACTOR:g}x the true derivative from the first step\n"
            "  none   correct (no alert expected)\n"
            "  missing-l2  a correct backward, but the training loop adds an L2 term the objective lacks and\n"
            "         scales fc1.weight.grad x3 after backward (the training verdict catches it)\n"
            "Prints the checks and alerts as they happen, a per-tensor summary, and the\n"
            "`tensorboard --logdir ...` command to open the charts."
        ),
        epilog=EXIT_CODES_TEXT.format(extra=" (--fail-on-alerts; raise_on stopping the run)"),
    )
    p.add_argument("--bug", choices=BUGS, default="late", help="which backward the custom activation has (default: late)")
    p.add_argument("--steps", type=int, default=defaults.steps, metavar="N", help=f"training steps (default: {defaults.steps})")
    p.add_argument("--log-dir", "--logdir", dest="log_dir", metavar="DIR", default=None,
                   help="where TensorBoard events and checks.jsonl go (default: runs/demo-<timestamp>); "
                   "must not hold a run already")
    p.add_argument("--config", metavar="YAML", default=None,
                   help="GradWatch options (see configs/); they override the demo's defaults, and flags override them")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seeds the data, the initialization, the batches and (unless --config sets seed) "
                   "GradWatch's sampling (default: 0)")
    p.add_argument("--fail-on-alerts", action="store_true", help="exit 1 when GradWatch raised any alert")
    g = p.add_argument_group(
        "GradWatch options",
        "Any GradWatch option, as in YAML (VALUE is read as YAML: 5, auto, 1e-4, '[fc1.*]', '{l2: 1e-4}', null).\n"
        "The training loss uses the same regularizers as the check objective.",
    )
    for name, default, meaning in options_table():
        if name in _DEMO_OWN_OPTIONS:
            continue
        shown = DEMO_OPTIONS.get(name, default)
        where = "demo default" if name in DEMO_OPTIONS else "default"
        meaning = meaning.replace("%", "%%")
        g.add_argument(_flag(name), dest=f"opt_{name}", metavar="VALUE", type=_yaml_value, default=None,
                       help=f"{meaning} ({where}: {show_value(shown)})")
    p.set_defaults(func=cmd_demo)


def _add_report(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        formatter_class=_Formatter,
        help="print a run's per-tensor trend table and alerts",
        description=(
            "Print the per-tensor trend table (first, last and worst judged rel_diff, last verdict,\n"
            "alerts, one mark per check) and the alerts of a run. Reads LOGDIR/checks.jsonl (a\n"
            "truncated last line is skipped with a warning); without it, the TensorBoard event files\n"
            "(scalars gradwatch/judged_rel_diff/*, alert text gradwatch/alerts). LOGDIR may also be\n"
            "the checks.jsonl file, or a folder of runs (e.g. Lightning's lightning_logs/ with its\n"
            "version_N/). Records are grouped by run id: a run resumed in a new folder reads as one\n"
            "run; runs appended to one folder are reported apart. Nothing readable exits 2;\n"
            "--fail-on-alerts passes (0) only when checks were read and none alerted."
        ),
        epilog=EXIT_CODES_TEXT.format(extra=" (--fail-on-alerts)"),
    )
    p.add_argument("logdir", metavar="LOGDIR", nargs="+",
                   help="run directory (the log_dir of GradWatch), its checks.jsonl, or a folder of runs; several "
                   "LOGDIRs are read together (a run resumed in a new folder is one run)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text for people, json for machines (default: text)")
    p.add_argument("--source", choices=("auto", "jsonl", "events"), default="auto",
                   help="read checks.jsonl or the event files; auto prefers checks.jsonl (default: auto)")
    p.add_argument("--fail-on-alerts", action="store_true",
                   help="exit 1 when a run has any alert, 2 when no check was recorded")
    p.add_argument("-v", "--verbose", action="store_true", help="print every alert's headline with its why and what to do "
                   "indented below it (default: the first alert's)")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write a self-contained HTML page: the summary, each part's verdict map, the alerts")
    p.set_defaults(func=cmd_report)


def _add_validate(sub: Any) -> None:
    p = sub.add_parser(
        "validate",
        formatter_class=_Formatter,
        help="check GradWatch YAML configs and print the effective options",
        description=(
            "Load each YAML config as GradWatch.from_config would and print every effective option\n"
            "(after defaults), marking those the file sets; or print what is wrong, naming the key."
        ),
        epilog=EXIT_CODES_TEXT.format(extra="").replace(
            "  1    alerts found and the command was asked to fail on them\n", ""),
    )
    p.add_argument("configs", metavar="CONFIG", nargs="+", help="YAML file(s) of GradWatch options")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text for people, json for machines (default: text)")
    p.set_defaults(func=cmd_validate)


BENCH_HELP = "measure what the checks cost (runs benchmarks/bench.py of a gradwatch source checkout)"
#: Where the benchmark lives in a source checkout (it is not part of the installed package).
BENCH_SCRIPT = Path("benchmarks") / "bench.py"
BENCH_MISSING = (
    "the benchmark ships with gradwatch's source tree, not with the installed package, and there is no "
    "{script} in {places}. Run it from a checkout of the gradwatch repository: `make bench`, "
    "`python benchmarks/bench.py [flags]`, or `gradwatch bench [flags]` in the checkout's root directory"
)


def _is_gradwatch_tree(root: Path) -> bool:
    pyproject = root / "pyproject.toml"
    try:
        return pyproject.is_file() and 'name = "gradwatch"' in pyproject.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def bench_roots() -> List[Path]:
    """Where ``gradwatch bench`` looks for ``benchmarks/bench.py``: the source tree this package was
    imported from (an editable install, or a checkout on ``PYTHONPATH``), then the current directory."""
    return [Path(__file__).resolve().parents[2], Path.cwd()]


def find_bench(roots: Optional[Sequence[Path]] = None) -> Optional[Path]:
    """The benchmark script of the first gradwatch source tree among ``roots`` (default :func:`bench_roots`).

    Returns:
        The path of ``benchmarks/bench.py``, or None when no root is a gradwatch checkout that holds it.

    Example:
        >>> import tempfile
        >>> find_bench([Path(tempfile.gettempdir())]) is None
        True
    """
    for root in bench_roots() if roots is None else roots:
        script = Path(root) / BENCH_SCRIPT
        if script.is_file() and _is_gradwatch_tree(Path(root)):
            return script
    return None


def load_bench(script: Path) -> ModuleType:
    """Import the benchmark script ``script`` as a module (once per path)."""
    name = "gradwatch_benchmarks_bench"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(script):
        return loaded
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the benchmark {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _add_bench(sub: Any, with_bench: bool) -> None:
    p = sub.add_parser("bench", formatter_class=_Formatter, help=BENCH_HELP, description=BENCH_HELP + ".")
    script = find_bench() if with_bench else None  # imported only for `gradwatch bench`: other commands start quickly
    if script is not None:
        bench = load_bench(script)
        bench.add_arguments(p)
        p.set_defaults(func=bench.run)


def _bench_missing() -> int:
    places = " or ".join(dict.fromkeys(str(root) for root in bench_roots()))
    return _fail("bench", BENCH_MISSING.format(script=BENCH_SCRIPT.as_posix(), places=places))


# --------------------------------------------------------------------- validate

def _raw_keys(path: str) -> List[str]:
    """Option names a YAML file sets explicitly, those in its groups too (call after :func:`load_config` succeeded)."""
    return config_keys(path)


def cmd_validate(args: argparse.Namespace) -> int:
    status = EXIT_OK
    docs: List[Dict[str, Any]] = []
    for path in args.configs:
        try:
            cfg = load_config(path)
            keys = _raw_keys(path)
        except ConfigError as err:
            status = EXIT_USAGE
            problems = config_problems(path) or [str(err)]
            if args.format == "json":
                docs.append({"path": path, "valid": False, "error": problems[0], "errors": problems})
            else:
                for problem in problems:
                    print(f"gradwatch validate: error: {problem}", file=sys.stderr)
            continue
        options = cfg.to_dict()
        if args.format == "json":
            docs.append({"path": path, "valid": True, "options": options, "set": keys})
            continue
        print(f"{path}: valid ({len(keys)} of {len(options)} options set in the file, the rest are defaults)")
        width = max(len(k) for k in options)
        values = {k: show_value(v) for k, v in options.items()}
        vwidth = max(len(v) for v in values.values())
        for k in options:
            print(f"  {k.ljust(width)}  {values[k].ljust(vwidth)}  {'(file)' if k in keys else '(default)'}".rstrip())
    if args.format == "json":
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    return status


# --------------------------------------------------------------------- report

def cmd_report(args: argparse.Namespace) -> int:
    from gradwatch.io import runs as summary

    try:
        found = summary.find_runs(args.logdir, args.source)
    except summary.RunNotFound as err:
        return _fail("report", str(err))
    try:
        runs, warnings = summary.read_runs(found)
    except OSError as err:
        return _fail("report", f"cannot read {getattr(err, 'filename', None) or args.logdir}: {err.strerror or err}")
    except Exception as err:  # noqa: BLE001 - a corrupt event file: say so, no traceback
        return _fail("report", f"cannot read TensorBoard events in {', '.join(str(p) for _, p in found)}: "
                               f"{type(err).__name__}: {err}")
    for w in warnings:
        print(f"gradwatch report: warning: {w}", file=sys.stderr)
    places = ", ".join(str(p) for _, p in found)
    if not runs:
        return _fail("report", f"{places}: nothing readable (empty, or no gradwatch record in it)")
    docs = []
    pages = []
    for i, data in enumerate(runs):
        rows = summary.summarize(data)
        if args.html:
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                _print_report(data, rows, verbose=True)
            pages.append((data, text.getvalue()))
        if args.format == "json":
            docs.append({"run_id": data.run_id, **summary.to_json(data, rows)})
            continue
        if len(runs) > 1:
            print(f"{'' if i == 0 else chr(10)}=== run {i + 1} of {len(runs)}"
                  f"{f' (run_id {data.run_id})' if data.run_id else ''} ===")
        _print_report(data, rows, verbose=args.verbose)
    if args.format == "json":
        print(json.dumps(docs[0] if len(docs) == 1 else {"runs": docs}, indent=2, allow_nan=False))
    if args.html:
        from gradwatch.io.html_report import html_page

        try:
            Path(args.html).write_text(html_page(pages, title=f"gradwatch report: {places}"), encoding="utf-8")
        except OSError as err:
            return _fail("report", f"--html: cannot write {args.html}: {err.strerror or err}")
        print(f"gradwatch report: wrote {args.html}", file=sys.stderr)
    if args.fail_on_alerts:
        if any(data.alerts for data in runs):
            return EXIT_ALERTS
        if not any(data.check_steps for data in runs):
            return _fail("report", f"--fail-on-alerts: {places} holds no check, so there is nothing to pass")
    return EXIT_OK


def _print_report(data: Any, rows: List[Dict[str, Any]], verbose: bool) -> None:
    from gradwatch.io import runs as summary

    uni = unicode_ok()
    steps = data.check_steps
    span = "" if not steps else f", step {steps[0]}" if steps[0] == steps[-1] else f", steps {steps[0]}-{steps[-1]}"
    print(f"{data.path} ({'TensorBoard event files' if data.source == 'events' else 'checks.jsonl'})")
    print(f"{plural(len(steps), 'check')}{span}, {plural(len(data.history), 'tensor')}, "
          f"{plural(len(data.alerts), 'alert')}")
    if data.source == "events":
        print("(from event files: values are float32, verdicts re-derived with the default bands)")
    forms = getattr(data, "forms", None)
    if forms and set(forms) != {"objective"}:
        print("backward part's form: " + ", ".join(f"{plural(n, 'check')} {form}" for form, n in sorted(forms.items()))
              + " (module: each unit alone, see docs/guides/big-models.md)")
    coverage = getattr(data, "coverage", None)
    if coverage:
        print(summary.coverage_line(coverage, getattr(data, "cycle_length", None), len(steps),
                                    getattr(data, "steps_to_full", None)))
    if getattr(data, "independence", None):
        print(summary.independence_line(data.independence))
    for line in data.update.lines(len(steps), data.alerts, data.source):  # the optimizer's step after each check
        print(line)
    for line in not_judged.unchecked_lines(getattr(data, "not_checked", None) or {}, len(steps)):
        print(line)
    for note in getattr(data, "unchecked", None) or ():
        print(f"not checked: {note}")
    for line in not_judged.report_lines(getattr(data, "not_judged", None) or {}):
        print(line)
    print()
    if rows:
        for line in summary.verdict_tables(data, data.bands, unicode=uni, rows=rows):
            print(line)
    else:
        print("  no checks recorded")
    _print_alerts(data.alerts, data.bands, data.details, verbose=verbose)


def _print_alerts(alerts: List[Dict[str, Any]], bands: Any, details: Dict[Any, Any], *, verbose: bool,
                  title: str = "Alerts") -> None:
    from gradwatch.io import runs as summary

    print()
    if not alerts:
        print(f"{title}: none")
        return
    print(f"{title} ({len(alerts)}):")
    width = max(len(str(a.get("tensor"))) for a in alerts)
    for a in alerts:
        detail = details.get(summary.detail_key(a.get("step"), a.get("tensor"), a.get("part")))
        print("  " + summary.format_alert(a, bands=bands, detail=detail, name_width=width))
    shown = alerts if verbose else alerts[:1]
    print()
    print("Why and what to do" + (":" if verbose or len(alerts) == 1 else ", for the first alert (-v for all):"))
    for a in shown:  # its headline, then why and what to do indented below it
        for line in summary.wrap_message(a, indent="  "):
            print(line)


# --------------------------------------------------------------------- demo

def _default_demo_dir() -> Path:
    base = Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _demo_config(args: argparse.Namespace) -> Tuple[GradWatchConfig, Optional[str]]:
    """Effective options: defaults < demo defaults < --config < option flags; and an error message."""
    from gradwatch.cli.demo import demo_config

    cfg = demo_config()
    file_keys: List[str] = []
    if args.config is not None:
        try:
            loaded = load_config(args.config)
            file_keys = _raw_keys(args.config)
        except ConfigError as err:
            return cfg, str(err)
        try:
            cfg = cfg.replace(**{k: getattr(loaded, k) for k in file_keys})
        except ConfigError as err:
            return cfg, f"{args.config}: {err}"
    for name in option_names():
        value = getattr(args, f"opt_{name}", None)
        if value is None:
            continue
        try:
            cfg = cfg.replace(**{name: value})
        except ConfigError as err:
            msg = str(err)
            if msg.startswith(f"{name}: "):
                msg = msg[len(name) + 2:]
            return cfg, f"{_flag(name)}: {msg}"
    overrides: Dict[str, Any] = {}
    if "seed" not in file_keys:
        overrides["seed"] = args.seed
    log_dir = args.log_dir or cfg.log_dir or str(_default_demo_dir())
    overrides["log_dir"] = log_dir
    try:
        cfg = cfg.replace(**overrides)
    except ConfigError as err:
        return cfg, str(err).replace("seed: ", "--seed: ").replace("log_dir: ", "--log-dir: ")
    return cfg, None


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from gradwatch.check.numerics.sampling import match_names
    from gradwatch.cli.demo import DemoSettings, SpiralNet, run_demo
    from gradwatch.cli.demo_print import DemoPrinter
    from gradwatch.io import runs as summary

    if args.steps < 1:
        return _fail("demo", f"--steps: got {args.steps}, expected an integer >= 1")
    cfg, error = _demo_config(args)
    if error is not None:
        return _fail("demo", error)
    log_dir = Path(cast(str, cfg.log_dir))  # _demo_config always sets it
    if (log_dir / "checks.jsonl").exists() or summary.event_files(log_dir):
        return _fail("demo", f"--log-dir {log_dir} already holds a run; choose a new directory (or remove it)")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return _fail("demo", f"cannot create --log-dir {log_dir}: {err.strerror or err}")
    settings = DemoSettings(bug=args.bug, steps=args.steps, seed=args.seed)
    names = [n for n, _ in SpiralNet(hidden=4).named_parameters()]
    try:
        match_names(names, cfg.tensors)
    except ValueError as err:
        return _fail("demo", str(err))
    printer = DemoPrinter(settings, cfg, names)
    printer.header()
    # The demo's network is tiny: one thread avoids oversubscription stalls on small machines.
    threads = torch.get_num_threads()
    gw_logger = logging.getLogger("gradwatch")
    saved = (gw_logger.level, gw_logger.propagate, list(gw_logger.handlers))
    gw_logger.handlers[:] = [logging.NullHandler()]
    gw_logger.propagate = False
    torch.set_num_threads(1)
    try:
        result = run_demo(settings, cfg, on_check=printer.check, on_grow=printer.grow)
    except BrokenPipeError:
        raise
    except (GradWatchError, OSError, ValueError, TypeError) as err:  # a bad option met at construction
        return _fail("demo", str(err))
    finally:
        torch.set_num_threads(threads)
        gw_logger.setLevel(saved[0])
        gw_logger.propagate = saved[1]
        gw_logger.handlers[:] = saved[2]
    alerts = printer.summary(result, log_dir)
    if result.stopped_early is not None:
        return EXIT_ALERTS
    if args.fail_on_alerts and alerts:
        return EXIT_ALERTS
    return EXIT_OK


# --------------------------------------------------------------------- entry point

def _command_of(argv: Sequence[str]) -> Optional[str]:
    for token in argv:
        if not token.startswith("-"):
            return token
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``gradwatch`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):  # alert messages hold non-ASCII text; never crash on printing it
        try:
            stream.reconfigure(errors="replace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass
    command = _command_of(argv)
    if command == "bench" and find_bench() is None:
        return _bench_missing()
    parser = build_parser(with_bench=command == "bench")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("gradwatch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `gradwatch report ... | head`: the reader left; exit quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
