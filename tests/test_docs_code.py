"""Every fenced code block of README.md and docs/**/*.md runs here, or says beside it which test runs it;
and the documentation site builds with ``mkdocs build --strict``.

A block's *marker* is an HTML comment on the line right before its opening fence (pages do not show it).
The rules, by the fence's language:

``python``
    Run with ``exec`` in this process, in a fresh namespace, with a temporary directory as the working
    directory. A page's python blocks run in order, each in its own namespace, unless marked:

    - ``<!-- continues -->``: runs in the namespace of the page's previous python block (its names carry over);
    - ``<!-- given: NAME -->``: the namespace starts with what ``GIVEN[NAME]`` below defines: the objects a
      fragment takes from the prose around it (``model``, ``loss_fn``, ``opt``, ...);
    - ``<!-- not run: WHY; tested by tests/FILE.py::TEST -->``: not run here (it needs torchrun or two ranks);
      ``TEST`` must be a test function of ``tests/FILE.py``.

    A block that defines ``test_*`` functions is a pytest example: each is called. A block passes when it
    raises nothing (the asserts written in it included); the GradWatch objects it leaves are then closed.

``sh``, ``bash``, ``console``: one command per line, ``#`` starting a comment.

    - ``make TARGET [VAR=...]``: ``make -n TARGET`` succeeds in the repository root, and every `backticked`
      command in the line's comment is in what it would run;
    - ``pip install gradwatch`` or ``pip install 'gradwatch[EXTRA]'``: ``EXTRA`` is an optional dependency
      group of pyproject.toml;
    - ``gradwatch COMMAND ...``: ``gradwatch COMMAND --help`` exits 0 and names every ``--flag`` and
      ``{choice,...}`` of the line (``gradwatch --version`` runs);
    - any other command fails here: give it a rule first.

``yaml``: loaded with ``yaml.safe_load``; a mapping with a ``gradwatch:`` section, or whose keys are all
    gradwatch options, is a config: ``gradwatch.load_config`` accepts it and ``gradwatch validate`` exits 0.

A fence with no language (or ``text``) is output, and must carry one of these markers:

    - ``<!-- output: demo --bug BUG [| demo --bug BUG2] -->``: lines printed by ``gradwatch demo --bug BUG``
      (its defaults, 200 steps) or by ``gradwatch report`` on that run's log directory, both run here;
    - ``<!-- output of the block above -->``: what the page's previous python block printed;
    - ``<!-- usage -->``: each line is a ``gradwatch`` command synopsis, checked as an ``sh`` line.

    Output is compared line by line: every line of the block but ``...`` must be a line of the real output
    after normalizing both: runs of spaces collapsed; times (``4.2 s``), timestamps (``20250101-120000``) and
    the directory of an executable (``/x/bin/tensorboard``) masked; a ``, --bug BUG`` caption before a line's
    final colon dropped; and decimal numbers equal within 10% (printed figures move a little between CPUs).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import shlex
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch
import yaml
from docs_text import DOCS, README, ROOT, markdown_files
from torch import nn

import gradwatch
from gradwatch.cli import main as gradwatch_main
from gradwatch.config import OPTION_GROUPS

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(.*?)\s*-->\s*$")
SHELL = {"sh", "bash", "console"}
OUTPUT = {"", "text"}


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    marker: Optional[str]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> List[Block]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        found.append(Block(path, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2),
                           marker.group(1) if marker else None))
    return found


BLOCKS = [b for path in markdown_files() for b in blocks_of(path)]
PAGES_WITH_PYTHON = sorted({b.path for b in BLOCKS if b.lang == "python"})


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------ what a fragment takes from the prose


def _given_model() -> dict:
    """The plain loop's model, loss and optimizer, and a batch ``(x, y)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    x, y = torch.randn(64, 20), torch.randint(0, 3, (64,))
    return {"torch": torch, "nn": nn, "gradwatch": gradwatch, "GradWatch": gradwatch.GradWatch,
            "model": model, "loss_fn": loss_fn, "opt": opt, "x": x, "y": y, "batch": (x, y)}


def _given_numpy_net() -> dict:
    """examples/numpy_two_layer.py's net with its W1 bug fixed, and its data ``X``, ``y``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("numpy_two_layer", ROOT / "examples" / "numpy_two_layer.py")
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    np.random.seed(0)
    net = example.BrokenTwoLayerNet(4, 10, 3, std=1e-1, fixed=True)
    np.random.seed(1)
    return {"gradwatch": gradwatch, "np": np, "net": net, "X": 10 * np.random.randn(5, 4), "y": np.array([0, 1, 2, 2, 1])}


def _mlp(d_in: int, d_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def _given_critic() -> dict:
    """A critic on 8 features and its optimizer."""
    torch.manual_seed(0)
    critic = _mlp(8, 1)
    return {"torch": torch, "GradWatch": gradwatch.GradWatch, "critic": critic,
            "opt": torch.optim.SGD(critic.parameters(), lr=1e-3)}


class _GAN(nn.Module):
    """A generator and a critic with both losses; the noise comes with the batch ``(real, z)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator, self.critic = _mlp(4, 8), _mlp(8, 1)

    def critic_loss(self, batch):
        real, z = batch
        return self.critic(self.generator(z).detach()).mean() - self.critic(real).mean()

    def generator_loss(self, batch):
        return -self.critic(self.generator(batch[1])).mean()


def _given_gan() -> dict:
    """``gan`` (``gan.critic``, ``gan.generator``), its two optimizers and three batches ``data``."""
    gan = _GAN()
    g = torch.Generator().manual_seed(1)
    return {"GradWatch": gradwatch.GradWatch, "gan": gan,
            "data": [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)],
            "opt_c": torch.optim.SGD(gan.critic.parameters(), lr=1e-3),
            "opt_g": torch.optim.SGD(gan.generator.parameters(), lr=1e-3)}


class SpikeLayer(nn.Module):
    """A spike (a step function) whose backward is a sigmoid's: a surrogate gradient."""

    def forward(self, x):
        s = torch.sigmoid(4 * x)
        return (x > 0).to(x.dtype) + s - s.detach()


class _StraightThrough(nn.Module):
    """Rounding to a grid of 0.25, its gradient passed straight through."""

    def forward(self, z):
        return z + (torch.round(4 * z) / 4 - z).detach()


def _given_surrogates() -> dict:
    """A model with a straight-through quantizer named ``quant`` and a ``SpikeLayer``."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(6, 8), quant=_StraightThrough(), spike=SpikeLayer(),
                                      out=nn.Linear(8, 2)))

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    return {"torch": torch, "gradwatch": gradwatch, "GradWatch": gradwatch.GradWatch, "SpikeLayer": SpikeLayer,
            "model": model, "loss_fn": loss_fn, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "batch": (torch.randn(16, 6), torch.randint(0, 2, (16,)))}


GIVEN = {"model": _given_model, "numpy_net": _given_numpy_net, "critic": _given_critic, "gan": _given_gan,
         "surrogates": _given_surrogates}


# ------------------------------------------------------------------ the rules, every block under one


def _not_run(marker: str):
    match = re.fullmatch(r"not run: (.+); tested by (tests/[\w/]+\.py)::(\w+)", marker)
    return match and match.groups()


def test_every_block_has_a_rule():
    assert len(BLOCKS) >= 25, [b.where for b in BLOCKS]
    for b in BLOCKS:
        marker = b.marker or ""
        if b.lang == "python":
            assert (not marker or marker == "continues" or _not_run(marker)
                    or (marker.startswith("given: ") and marker[7:] in GIVEN)), f"{b.where}: unknown marker {marker!r}"
        elif b.lang in OUTPUT:
            assert re.fullmatch(r"output: demo --bug [\w-]+( \| demo --bug [\w-]+)*|output of the block above|usage",
                                marker), f"{b.where}: a block without a language needs an output or usage marker"
        else:
            assert b.lang in SHELL | {"yaml"}, f"{b.where}: no rule for ```{b.lang} blocks in {__file__}"


def test_readme_is_short_and_its_links_lead_somewhere():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10, links
    for link in links:
        assert (ROOT / link).is_file(), f"README.md links to {link}, which does not exist"


def test_every_page_has_one_title():
    for path in markdown_files():
        titles = re.findall(r"^# .+$", FENCE.sub("", path.read_text()), re.M)
        assert len(titles) == 1, f"{path.relative_to(ROOT)}: {len(titles)} first-level headings: {titles}"


# ------------------------------------------------------------------ python


def _close_watches(ns: dict) -> None:
    for value in ns.values():
        if isinstance(value, gradwatch.GradWatch):
            value.close()


@pytest.mark.parametrize("path", PAGES_WITH_PYTHON, ids=page_id)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed: Dict[int, str] = {}
    ns: dict = {}
    namespaces = []
    blocks = blocks_of(path)
    for b in blocks:
        if b.lang == "python":
            if b.marker and _not_run(b.marker):
                continue
            if b.marker != "continues":
                ns = {"__name__": "__docs__"}
                namespaces.append(ns)
                if b.marker and b.marker.startswith("given: "):
                    ns.update(GIVEN[b.marker[7:]]())
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(b.code, b.where, "exec"), ns)
                for name, value in list(ns.items()):
                    if name.startswith("test_") and callable(value):
                        value()
            printed[b.line] = out.getvalue()
        elif b.marker == "output of the block above":
            above = [p.line for p in blocks if p.lang == "python" and p.line < b.line]
            assert above and above[-1] in printed, f"{b.where}: no python block ran above it"
            assert_lines_shown(b, printed[above[-1]])
    for ran in namespaces:
        _close_watches(ran)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python" and b.marker and _not_run(b.marker)],
                         ids=lambda b: b.where)
def test_blocks_not_run_here_name_the_test_that_runs_them(block):
    _why, file, name = _not_run(block.marker)
    source = (ROOT / file).read_text()
    tests = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    assert name in tests, f"{block.where}: {file} has no test {name}"


# ------------------------------------------------------------------ output


def normalize(line: str) -> str:
    line = re.sub(r"\b\d+(\.\d+)? s\b", "<t> s", line)
    line = re.sub(r"\b\d{8}-\d{6}\b", "<timestamp>", line)
    line = re.sub(r"\S*/(tensorboard|gradwatch)\b", r"\1", line)
    line = re.sub(r", --bug [\w-]+:$", ":", line.strip())
    return " ".join(line.split())


NUMBER = re.compile(r"\d+\.\d+(?:e[+-]?\d+)?")


def same_line(shown: str, real: str) -> bool:
    if NUMBER.sub("#", shown) != NUMBER.sub("#", real):
        return False
    for a, b in zip(NUMBER.findall(shown), NUMBER.findall(real)):
        x, y = float(a), float(b)
        if abs(x - y) > 0.1 * max(abs(x), abs(y)):
            return False
    return True


def assert_lines_shown(block: Block, real_output: str) -> None:
    real = [normalize(line) for line in real_output.splitlines() if line.strip()]
    shown = [normalize(line) for line in block.code.splitlines() if line.strip() and line.strip() != "..."]
    assert shown, block.where
    for line in shown:
        assert any(same_line(line, r) for r in real), f"{block.where}: not in the real output: {line!r}"


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory) -> Dict[str, str]:
    """``gradwatch demo --bug BUG`` and ``gradwatch report`` on its run, for each bug an output block names: what
    the commands print, run in this process (the CLI as a subprocess is tests/cli/test_commands.py's)."""
    import glob
    import os

    from gradwatch.cli import main

    bugs = sorted({bug for b in BLOCKS if b.marker and b.marker.startswith("output: demo")
                   for bug in re.findall(r"--bug ([\w-]+)", b.marker)})
    outputs = {}
    here = os.getcwd()
    for bug in bugs:
        os.chdir(tmp_path_factory.mktemp(f"demo-{bug}"))  # the demo writes runs/ where it is started
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # as a pipe in a UTF-8 locale: the report's charts
        try:
            with contextlib.redirect_stdout(out):
                assert main(["demo", "--bug", bug]) == 0, f"gradwatch demo --bug {bug}"
                print("=== report ===")
                assert main(["report", *glob.glob("runs/*")]) == 0, f"gradwatch report after the demo --bug {bug}"
        finally:
            os.chdir(here)
        out.flush()
        outputs[bug] = out.buffer.getvalue().decode("utf-8")  # type: ignore[attr-defined]
    return outputs


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker and b.marker.startswith("output: demo")],
                         ids=lambda b: b.where)
@pytest.mark.slow
def test_demo_output_blocks_are_what_the_demo_prints(block, demo_output):
    bugs = re.findall(r"--bug ([\w-]+)", block.marker)
    assert_lines_shown(block, "\n".join(demo_output[bug] for bug in bugs))


def test_the_output_comparison_fails_on_a_changed_figure_or_word():
    real = "    100   0.444  0.56     7.9  fc1.bias            6.8e-02  WRONG       excellent\nSummary: 20 checks in 6.1 s"
    ok = Block(README, 0, "", "  100 0.444 0.56 7.9 fc1.bias 6.8e-02 WRONG excellent\n...\nSummary: 20 checks in 4.2 s\n", None)
    assert_lines_shown(ok, real)
    for wrong in ("100 0.444 0.56 7.9 fc1.bias 9.8e-02 WRONG excellent", "100 0.444 0.56 7.9 fc1.bias 6.8e-02 WRONG WRONG",
                  "Summary: 21 checks in 4.2 s"):
        with pytest.raises(AssertionError):
            assert_lines_shown(Block(README, 0, "", wrong, None), real)


# ------------------------------------------------------------------ shell, usage


def _commands(block: Block) -> List[str]:
    """The block's commands; in a usage block an indented line continues the one before."""
    lines: List[str] = []
    for line in block.code.splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        if block.marker == "usage" and line[:1].isspace() and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line.strip())
    return lines


def _gradwatch_help(argv: List[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gradwatch_main(argv)
    assert code == 0, (argv, out.getvalue())
    return out.getvalue()


def check_shell_line(where: str, line: str) -> None:
    command, _, comment = line.partition(" #")
    words = shlex.split(command)
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w]
        dry = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True)
        assert dry.returncode == 0 and targets, f"{where}: {command}: {dry.stderr}"
        for promised in re.findall(r"`([^`]+)`", comment):
            assert promised in dry.stdout, f"{where}: `{command}` would not run `{promised}`:\n{dry.stdout}"
    elif words[:2] == ["pip", "install"]:
        table = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
        extras = set(re.findall(r"^([\w-]+)\s*=", table, re.M))
        for requirement in words[2:]:
            match = re.fullmatch(r"gradwatch(?:\[([\w,-]+)\])?", requirement)
            assert match, f"{where}: pip install {requirement}: not gradwatch"
            for extra in (match.group(1) or "").split(","):
                assert not extra or extra in extras, f"{where}: gradwatch has no extra {extra!r}"
    elif words[0] == "gradwatch":
        if words[1].startswith("--"):
            _gradwatch_help([words[1]])
            return
        text = _gradwatch_help([words[1], "--help"])
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", command):
            assert flag in text, f"{where}: `gradwatch {words[1]} --help` does not name {flag}"
        for choices in re.findall(r"\{[^}]+\}", command):
            assert choices in text, f"{where}: `gradwatch {words[1]} --help` does not offer {choices}"
    else:
        raise AssertionError(f"{where}: no rule for the command {words[0]!r} in {__file__}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in SHELL or b.marker == "usage"], ids=lambda b: b.where)
def test_shell_and_usage_lines_name_real_targets_commands_and_flags(block):
    lines = _commands(block)
    assert lines, block.where
    for line in lines:
        check_shell_line(block.where, line)


def test_the_shell_rules_fail_on_what_does_not_exist():
    for line in ("make nosuchtarget", "pip install 'gradwatch[nosuchextra]'", "gradwatch demo --no-such-flag",
                 "gradwatch report LOGDIR [--format {text,yaml}]", "make demo     # runs `gradwatch nosuch`", "rm -rf /"):
        with pytest.raises(AssertionError):
            check_shell_line("(example)", line)


# ------------------------------------------------------------------ yaml


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "yaml"], ids=lambda b: b.where)
def test_yaml_blocks_load_and_configs_validate(block, tmp_path):
    data = yaml.safe_load(block.code)
    options = {f.name for f in dataclasses.fields(gradwatch.GradWatchConfig)}
    section = data.get("gradwatch") if isinstance(data, dict) else None
    if section is None and isinstance(data, dict) and set(data) <= options | set(OPTION_GROUPS):
        section = data
    if section is None:
        return
    path = tmp_path / "config.yaml"
    path.write_text(block.code)
    config = gradwatch.load_config(path)
    keys = [k for key in section for k in (section[key] if key in OPTION_GROUPS else [key])]  # a group's options
    for key in keys:
        assert key in options, f"{block.where}: {key} is not an option"
        assert hasattr(config, key), f"{block.where}: the config has no {key}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gradwatch_main(["validate", str(path)]) == 0, out.getvalue()
    for key in keys:
        assert key in out.getvalue(), f"{block.where}: `gradwatch validate` does not show {key}"


# ------------------------------------------------------------------ the site


@pytest.mark.slow
def test_the_site_builds_with_no_warning(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, env=None)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-5000:]
    for page in DOCS.rglob("*.md"):
        stem = page.relative_to(DOCS).with_suffix("")
        html = tmp_path / "site" / (stem.parent if stem.name == "index" else stem) / "index.html"
        assert html.is_file(), f"{page} was not built"
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("gradwatch.GradWatch", "gradwatch.check_model", "gradwatch.integrations.lightning.GradWatchCallback"):
        assert f'id="{name}"' in api, f"the API page does not document {name}"
