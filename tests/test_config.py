"""GradWatchConfig and load_config: shipped configs load, mistakes are refused with the key named."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import yaml

from gradwatch import TrendTracker
from gradwatch.config import OPTION_DOCS, GradWatchConfig, load_config, option_names, options_markdown, options_table
from gradwatch.errors import ConfigError
from gradwatch.options import CheckOptions

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: pathlib.Path, text: str, name: str = "bad.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, GradWatchConfig)
    assert isinstance(cfg.check_options(), CheckOptions)


def test_shipped_configs_present():
    assert {p.name for p in CONFIGS.glob("*.yaml")} >= {"default.yaml", "low_overhead.yaml", "strict.yaml"}


def test_default_yaml_lists_every_option_with_its_default_and_doc():
    path = CONFIGS / "default.yaml"
    assert list(yaml.safe_load(path.read_text())) == option_names()
    assert load_config(path) == GradWatchConfig()
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.split(":")[0]
        if key in OPTION_DOCS:
            assert lines[i - 1] == f"# {OPTION_DOCS[key]}", key


def test_low_overhead_and_strict_values():
    low = load_config(CONFIGS / "low_overhead.yaml")
    assert (low.every, low.overhead_budget, low.tensors_per_check, low.coords, low.directions) == ("auto", 0.005, 2, 4, 2)
    strict = load_config(CONFIGS / "strict.yaml")
    assert (strict.every, strict.tensors_per_check, strict.coords, strict.directions) == (1, 0, 32, 8)
    assert (strict.raise_on, strict.fail_at) == ("suspicious", "suspicious")


def test_check_option_names_and_defaults_match_check_options():
    cfg = GradWatchConfig()
    opts = CheckOptions()
    for name in CheckOptions.names():
        assert getattr(cfg.check_options(), name) == getattr(opts, name), name


def test_options_table_covers_every_option():
    table = options_table()
    assert [row[0] for row in table] == option_names() == list(OPTION_DOCS)
    assert all(isinstance(meaning, str) and meaning for _, _, meaning in table)


def test_each_option_is_declared_once_and_every_description_reads_that_declaration():
    # The help of a check option is the one CheckOptions declares; the config inherits the field itself.
    shared = option_names()[:len(CheckOptions.names())]
    assert shared == CheckOptions.names()
    for name in CheckOptions.names():
        assert OPTION_DOCS[name] in CheckOptions.__doc__, name
    for name, text in OPTION_DOCS.items():
        assert f"{name}: {text}" in GradWatchConfig.__doc__, name
    readme = (CONFIGS.parent / "docs" / "reference" / "options.md").read_text()
    assert options_markdown() in readme, "docs/reference/options.md's table differs from gradwatch.config.options_markdown()"


def test_bool_and_float_options_are_checked_from_their_declared_type():
    with pytest.raises(ConfigError, match=r"^jsonl: got 'yes', expected true or false$"):
        GradWatchConfig(jsonl="yes")
    with pytest.raises(ConfigError, match=r"^per_term: got 1, expected true or false$"):
        GradWatchConfig(per_term=1)
    assert GradWatchConfig(drift_decades="3", eps="1e-3").drift_decades == 3.0


def test_defaults_round_trip_through_dict_json_and_yaml():
    cfg = GradWatchConfig()
    d = cfg.to_dict()
    assert GradWatchConfig.from_dict(d) == cfg
    assert GradWatchConfig.from_dict(json.loads(json.dumps(d))) == cfg
    assert GradWatchConfig.from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    assert d["dtype"] == "float64" and d["bands"] == [1e-7, 1e-4, 1e-2]


def test_non_default_round_trip():
    cfg = GradWatchConfig(every=7, dtype=None, bands=(1e-6, 1e-3, 1e-1), raise_on="WRONG", regularizers={"l2": 1e-4},
                          tensors="encoder.*", log_dir=pathlib.Path("runs/x"))
    assert (cfg.raise_on, cfg.tensors, cfg.log_dir) == ("wrong", ["encoder.*"], "runs/x")
    assert GradWatchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_replace_revalidates_and_refuses_unknown_names():
    cfg = GradWatchConfig().replace(every=10, coords=2)
    assert (cfg.every, cfg.coords) == (10, 2)
    with pytest.raises(ConfigError, match="every"):
        cfg.replace(every=0)
    with pytest.raises(ConfigError, match="^cooords: unknown option, did you mean 'coords'"):
        cfg.replace(cooords=3)


def test_scientific_notation_strings_load_as_numbers(tmp_path):
    path = write(tmp_path, "eps: 1e-6\noverhead_budget: 5e-3\nbands: [1e-8, 1e-5, 1e-3]\ndrift_decades: 3\n"
                           "regularizers: {l2: 1e-4}\n", "sci.yaml")
    cfg = load_config(path)
    assert cfg.eps == 1e-6 and cfg.overhead_budget == 5e-3
    assert cfg.bands == (1e-8, 1e-5, 1e-3)
    assert cfg.regularizers == {"l2": 1e-4}
    assert cfg.drift_decades == 3.0 and isinstance(cfg.drift_decades, float)


def test_gradwatch_section_in_a_larger_config(tmp_path):
    path = write(tmp_path, "model: resnet\nlr: 0.1\ngradwatch:\n  every: 25\n", "train.yaml")
    assert load_config(path).every == 25
    path = write(tmp_path, "model: resnet\ngradwatch:\n  every: -5\n", "train.yaml")
    with pytest.raises(ConfigError, match=r"train\.yaml: gradwatch\.every: got -5"):
        load_config(path)


def test_empty_file_means_defaults(tmp_path):
    assert load_config(write(tmp_path, "", "empty.yaml")) == GradWatchConfig()
    assert load_config(write(tmp_path, "# only a comment\n", "comment.yaml")) == GradWatchConfig()


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("evry: 10\n", r"bad\.yaml: evry: unknown option, did you mean 'every'"),
        ("overhead-budget: 0.1\n", r"bad\.yaml: overhead-budget: unknown option, did you mean 'overhead_budget'"),
        ("every: -5\n", r"bad\.yaml: every: got -5, expected an integer >= 1 or 'auto'"),
        ("every: 0\n", r"bad\.yaml: every: got 0, expected"),
        ("every: often\n", r"bad\.yaml: every: got 'often'"),
        ("every: 2.5\n", r"bad\.yaml: every: got 2\.5"),
        ("coords: eight\n", r"bad\.yaml: coords: got 'eight'"),
        ("coords: '8'\n", r"bad\.yaml: coords: got '8'"),
        ("coords: true\n", r"bad\.yaml: coords: got True"),
        ("overhead_budget: lots\n", r"bad\.yaml: overhead_budget: got 'lots'"),
        ("overhead_budget: 0\n", r"bad\.yaml: overhead_budget: got 0, expected a number with 0 < x <= 1"),
        ("overhead_budget: 1.5\n", r"bad\.yaml: overhead_budget: got 1\.5"),
        ("eps: small\n", r"bad\.yaml: eps: got 'small'"),
        ("raise_on: maybe\n", r"bad\.yaml: raise_on: got 'maybe', expected null \(never\), 'wrong' or 'suspicious'"),
        ("dtype: float16\n", r"bad\.yaml: dtype: got 'float16', expected 'float64', 'float32'"),
        ("fail_at: excellent\n", r"bad\.yaml: fail_at: got 'excellent'"),
        ("tensors_per_check: -1\n", r"bad\.yaml: tensors_per_check: got -1"),
        ("pace: 0\n", r"bad\.yaml: pace: got 0, expected a number of training steps > 0 \(2\.0\) or null \(no pace\)"),
        ("pace: fast\n", r"bad\.yaml: pace: got 'fast'"),
        ("baseline_checks: 0\n", r"bad\.yaml: baseline_checks: got 0, expected an integer >= 1"),
        ("drift_window: 0\n", r"bad\.yaml: drift_window: got 0"),
        ("drift_decades: -1\n", r"bad\.yaml: drift_decades: got -1"),
        ("alert_cooldown: -1\n", r"bad\.yaml: alert_cooldown: got -1"),
        ("tensorboard: 'yes please'\n", r"bad\.yaml: tensorboard: got 'yes please', expected true or false"),
        ("jsonl: 1\n", r"bad\.yaml: jsonl: got 1"),
        ("bands: [1e-2, 1e-4, 1e-7]\n", r"bad\.yaml: bands must be three increasing"),
        ("regularizers: {l3: 0.1}\n", r"bad\.yaml: regularizers: unknown built-in 'l3'"),
        ("regularizers: {l2: much}\n", r"bad\.yaml: regularizers: 'l2' must map to a coefficient"),
        ("regularizers: {l2: -1.0}\n", r"bad\.yaml: regularizers: 'l2' coefficient must be >= 0"),
        ("log_dir: [a, b]\n", r"bad\.yaml: log_dir: got \['a', 'b'\]"),
    ],
)
def test_bad_values_are_refused_naming_file_key_and_value(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize("text, what", [("- every\n- 10\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path, text, what):
    with pytest.raises(ConfigError, match=rf"bad\.yaml: expected a mapping of option: value at the top level, got {what}"):
        load_config(write(tmp_path, text))


def test_gradwatch_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"bad\.yaml: gradwatch: got list"):
        load_config(write(tmp_path, "gradwatch: [1, 2]\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml_syntax(tmp_path):
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML at line \d+, column \d+: .*line 2, column 9"):
        load_config(write(tmp_path, "every: 10\ncoords: [1, 2\n"))


def test_keyword_construction_validates_without_a_source():
    with pytest.raises(ConfigError, match=r"^every: got -5, expected an integer >= 1 or 'auto'$"):
        GradWatchConfig(every=-5)
    with pytest.raises(ConfigError, match=r"^<dict>: raise_on: got 'maybe'"):
        GradWatchConfig.from_dict({"raise_on": "maybe"})
    with pytest.raises(ConfigError, match="expected a mapping"):
        GradWatchConfig.from_dict([("every", 1)])


def test_callable_regularizers_allowed_from_python():
    def smooth(model):
        return 0.0

    cfg = GradWatchConfig(regularizers={"smooth": smooth, "l1": 1e-5})
    assert cfg.regularizers["smooth"] is smooth
    d = cfg.to_dict()
    assert d["regularizers"]["l1"] == 1e-5
    assert d["regularizers"]["smooth"].startswith("<callable ") and "smooth" in d["regularizers"]["smooth"]
    json.dumps(d)


def test_trend_tracker_uses_config_settings():
    tracker = TrendTracker(**GradWatchConfig(bands=(1e-6, 1e-3, 1e-1), drift_window=5, alert_cooldown=0).trend_kwargs())
    assert (tracker.bands, tracker.drift_window, tracker.alert_cooldown) == ((1e-6, 1e-3, 1e-1), 5, 0)


def test_numpy_dtypes_are_accepted_wherever_dtype_is():
    import numpy as np
    from torch import nn

    from gradwatch import GradWatch, check_model
    from gradwatch.options import parse_dtype

    assert parse_dtype(np.float64) is torch.float64 and parse_dtype(np.dtype("float32")) is torch.float32
    with pytest.raises(ConfigError, match="int64"):
        parse_dtype(np.int64)
    model = nn.Linear(3, 1)
    report = check_model(model, lambda m, b: m(b).pow(2).sum(), torch.randn(4, 3), dtype=np.float64)
    assert report.ok and report.dtype == "float64"
    watch = GradWatch(model, lambda m, b: m(b).pow(2).sum(), dtype=np.float32, log_dir=None)
    assert watch._check_options.dtype is torch.float32
    watch.close()
