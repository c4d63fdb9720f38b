"""What ``gradwatch demo`` prints: a header, a line per (some) checks, alerts as they happen, the summary.

:mod:`gradwatch.cli.demo` tells the story and prints nothing; :mod:`gradwatch.cli.commands` parses the
flags and hands :func:`~gradwatch.cli.demo.run_demo` this printer's callbacks.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gradwatch.cli.console import plural, runnable, unicode_ok
from gradwatch.cli.demo import GRAD_FACTOR, LATE_THRESHOLD, MISSING_L2, SCALE_FACTOR, DemoResult
from gradwatch.config import GradWatchConfig
from gradwatch.io import runs


class DemoPrinter:
    """The demo's console output: a header, one line per (some) checks, alerts as they happen, the summary.

    Args:
        settings: The demo's :class:`~gradwatch.cli.demo.DemoSettings`.
        cfg: The effective GradWatch options.
        names: The model's parameter names (for the column width).
        out: Where to print (default ``sys.stdout``).

    Example:
        >>> import io
        >>> from gradwatch.cli.demo import DemoSettings, demo_config
        >>> out = io.StringIO()
        >>> DemoPrinter(DemoSettings(bug="none"), demo_config({"log_dir": "runs/x"}), ["fc1.weight"], out).header()
        >>> "Bug 'none'" in out.getvalue()
        True
    """

    HEAD = "   step    loss   acc  max|x|  worst tensor   judged rel_diff  backward    training"

    def __init__(self, settings: Any, cfg: GradWatchConfig, names: List[str], out: Any = None) -> None:
        self.settings, self.cfg, self.out = settings, cfg, out or sys.stdout
        self.name_width = max(len(n) for n in names)
        expected = settings.steps / cfg.every if isinstance(cfg.every, int) else 0
        self.every_nth = max(1, round(expected / 10)) if expected else 1
        self.last_verdict: Optional[str] = None
        self.details: Dict[Tuple[int, str], Dict[str, Any]] = {}
        self.check_seconds = 0.0

    def p(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def header(self) -> None:
        s, c = self.settings, self.cfg
        story = {
            "late": f"its backward is right for |x| < {LATE_THRESHOLD:g} and wrong beyond. Small weights keep its inputs\n"
                    f"  below {LATE_THRESHOLD:g}; at step {s.grow_at} the first layer's weights are scaled x{s.grow_factor:g} "
                    "(\"weights grow\").",
            "scale": f"its backward is {SCALE_FACTOR:g}x the true derivative, from the first step.",
            "none": f"its backward is correct; no alert is expected, even after the weights grow at step {s.grow_at}.",
            "missing-l2": f"its backward is correct, but the training loop adds {MISSING_L2:g} * ||p||^2 to the loss (a term\n"
                          f"  the watch's objective lacks) and multiplies fc1.weight.grad by {GRAD_FACTOR:g} after backward(). The\n"
                          "  backward verdict stays clean; the training verdict (live .grad vs the objective) catches both.",
        }[s.bug]
        regs = c.regularizers if isinstance(c.regularizers, dict) else None
        reg_text = ", ".join(f"{k} {v:g}" for k, v in regs.items()) if regs else "none"
        if isinstance(c.every, int):
            every = "every step" if c.every == 1 else f"every {c.every} steps"
        else:
            every = f"within {c.overhead_budget:.1%} of the time (every: auto)"
        tensors = "all tensors" if c.tensors_per_check == 0 else f"{c.tensors_per_check} tensors"
        self.p(f"gradwatch demo: a 2-{s.hidden}-{s.hidden}-3 network on 3-class spirals ({3 * s.points_per_class} "
               f"points), with BatchNorm, dropout {s.dropout:g},")
        self.p(f"  regularizers in the loss ({reg_text}), SGD weight decay {s.weight_decay:g}, and a custom SiLU "
               "autograd.Function.")
        self.p(f"Bug '{s.bug}': {story}")
        self.p(f"GradWatch checks {every}, {tensors} per check, on a {c.dtype or 'in-place'} "
               f"{'shadow copy' if c.dtype else 'check'}; logs in {c.log_dir}")
        self.p()
        self.p(self.HEAD)

    @staticmethod
    def _training_text(report: Any) -> str:
        """The worst training verdict of a check (``-`` when the training part did not judge)."""
        judged = [t for t in report.training.values() if t.verdict is not None]
        if not judged:
            return "-"
        worst = max(judged, key=lambda t: t.verdict.rank)
        return runs.verdict_text(worst.verdict.value)

    def grow(self, ev: Any) -> None:
        self.p(f"  {ev.step:5d}  weights grow: {' and '.join(ev.tensors)} x{ev.factor:g}; largest |x| into the "
               f"custom SiLU {ev.max_abs_before:.1f} -> {ev.max_abs_after:.1f}")

    def check(self, ev: Any) -> None:
        report = ev.report
        if report is not None:
            self.check_seconds += report.seconds
            for name, t in report.tensors.items():
                self.details[(ev.step, name)] = {"verdict": t.verdict.value if t.verdict else None, "diagnosis": t.diagnosis}
            for name, tc in report.training.items():
                self.details[runs.detail_key(ev.step, name, "training")] = {
                    "verdict": tc.verdict.value if tc.verdict else None, "diagnosis": tc.diagnosis}
        worst = report.worst if report is not None else None
        verdict = worst.verdict.value if worst is not None else None
        show = (
            ev.index == 0 or ev.alerts or verdict != self.last_verdict or ev.index % self.every_nth == 0
            or ev.step >= self.settings.steps - (self.cfg.every if isinstance(self.cfg.every, int) else 1)
        )
        self.last_verdict = verdict
        if show and report is not None:
            if worst is not None:
                name = worst.name if worst.judged_rel_diff != 0 else "(none)"  # every checked tensor within the noise
                w = (f"{name:<{self.name_width}}  {runs.fmt(worst.judged_rel_diff):>15}  "
                     f"{runs.verdict_text(verdict):<10}  {self._training_text(report)}")
            else:
                w = "no verdict" + (" (objective not finite)" if report.nonfinite else "")
            self.p(f"  {ev.step:5d}  {ev.loss:6.3f}  {ev.accuracy:4.2f}  {ev.max_abs_input:6.1f}  {w}")
        for a in ev.alerts:
            detail = self.details.get(runs.detail_key(a.step, a.tensor, a.part))
            self.p("         ! " + runs.format_alert(a.to_dict(), bands=self.cfg.bands, detail=detail,
                                                   name_width=self.name_width))
        if ev.stopped:
            self.p(f"  {ev.step:5d}  stopped: raise_on={self.cfg.raise_on} matched (GradientDriftError)")

    def summary(self, result: DemoResult, log_dir: Path) -> List[Dict[str, Any]]:
        """Print the end of the demo: a per-tensor table for each verdict, the alerts, the commands to look again.

        Returns:
            The alerts of the run (as ``checks.jsonl`` records).
        """
        p = self.p
        data = runs.from_watch(result.watch, self.details)
        rows = runs.summarize(data)
        uni = unicode_ok()
        p()
        stop = f", stopped at step {data.check_steps[-1] if data.check_steps else 0} by raise_on" if result.stopped_early else ""
        p(f"Summary: {result.steps} steps, {plural(result.checks, 'check')} in {result.seconds:.1f} s "
          f"(checks {self.check_seconds:.1f} s), accuracy {result.final_accuracy:.0%}{stop}")
        for line in runs.verdict_tables(data, self.cfg.bands, unicode=uni, heading_indent="  ", rows=rows):
            p(line)
        p()
        alerts = data.alerts
        if alerts:
            tensors = list(dict.fromkeys(str(a["tensor"]) for a in alerts))
            p(f"{plural(len(alerts), 'alert')} on {', '.join(tensors)}; first at step {alerts[0]['step']}:")
            for line in runs.wrap_message(alerts[0], indent="  "):
                p(line)
            if self.settings.bug == "late":
                p("  Here: fc1 feeds the custom SiLU, whose backward drops a term once |x| >= 3.")
            elif self.settings.bug == "scale":
                p("  Here: fc1 feeds the custom SiLU, whose backward has a stray factor.")
            elif self.settings.bug == "missing-l2":
                p("  Here: the training loss has an L2 term the objective lacks, and fc1.weight.grad is scaled after backward.")
        else:
            p("No alerts: every checked gradient agreed with its two-sided numerical estimate.")
        p()
        q = shlex.quote(str(log_dir))
        if self.cfg.tensorboard:
            p("Charts (SCALARS: gradwatch/judged_rel_diff/* (backward), gradwatch/training/rel_diff/* (training); "
              "CUSTOM SCALARS: gradwatch; TEXT: gradwatch/alerts):")
            p(f"  {runnable('tensorboard')} --logdir {q}")
        if self.cfg.tensorboard or self.cfg.jsonl:
            p("This summary again, later:")
            p(f"  {runnable('gradwatch')} report {q}")
        return alerts
