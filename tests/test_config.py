"""GradWatchConfig and load_config: shipped configs load, mistakes are refused with the key named."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import yaml

from gradwatch import TrendTracker
from gradwatch.config import (
    OFF_OPTIONS,
    OPTION_DOCS,
    OPTION_GROUPS,
    GradWatchConfig,
    config_keys,
    load_config,
    option_names,
    options_markdown,
    options_table,
    parse_distributed,
    resolve_config,
)
from gradwatch.errors import ConfigError
from gradwatch.options import ONE_SHOT_OPTIONS, CheckOptions, SharedOptions

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
    # The help of a check option is the one SharedOptions declares; the config and CheckOptions inherit the field itself.
    shared = option_names()[:len(SharedOptions.names())]
    assert shared == SharedOptions.names() == CheckOptions.names()[:len(shared)]
    for name in SharedOptions.names():
        assert OPTION_DOCS[name] in SharedOptions.__doc__ and OPTION_DOCS[name] in CheckOptions.__doc__, name
    for name, text in OPTION_DOCS.items():
        assert f"{name}: {text}" in GradWatchConfig.__doc__, name
    readme = (CONFIGS.parent / "docs" / "reference" / "options.md").read_text()
    assert options_markdown() in readme, "docs/reference/options.md's table differs from gradwatch.config.options_markdown()"


def test_check_models_one_shot_options_are_not_options_of_the_watch():
    # localize, batched and screen are fields of CheckOptions (check_model's), not keys of the YAML config
    assert CheckOptions.names() == SharedOptions.names() + list(ONE_SHOT_OPTIONS)
    assert not set(ONE_SHOT_OPTIONS) & set(option_names())
    assert GradWatchConfig().check_options() == CheckOptions()
    for name in ONE_SHOT_OPTIONS:
        with pytest.raises(ConfigError, match=f"^run.yaml: {name}: unknown option"):
            GradWatchConfig.from_dict({name: True}, source="run.yaml")


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
        ("raise_on: maybe\n", r"bad\.yaml: raise_on: got 'maybe', expected 'off' \(never\), 'wrong' or 'suspicious'$"),
        ("dtype: float16\n", r"bad\.yaml: dtype: got 'float16', expected 'float64', 'float32'"),
        ("fail_at: excellent\n", r"bad\.yaml: fail_at: got 'excellent', expected 'wrong' or 'suspicious'$"),
        ("tensors_per_check: -1\n", r"bad\.yaml: tensors_per_check: got -1"),
        ("pace: 0\n", r"bad\.yaml: pace: got 0, expected a number of training steps > 0 \(2\.0\) or off \(no pace\)"),
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


# ---------------------------------------------------------------- groups, config=, off, fail_at and raise_on


def test_every_option_is_in_one_group_under_its_one_name():
    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(option_names())
    assert not set(OPTION_GROUPS) & set(option_names())


def test_groups_are_the_flat_options_as_keywords_and_yaml_sections(tmp_path):
    flat = GradWatchConfig(every=50, max_interval="30 min", raise_on="wrong", coords=4, log_dir="runs/x")
    grouped = {"schedule": {"every": 50, "max_interval": "30 min"}, "alerts": {"raise_on": "wrong"}, "coords": 4,
               "logging": {"log_dir": "runs/x"}}
    assert GradWatchConfig().replace(**grouped) == flat
    assert GradWatchConfig.from_dict(grouped) == flat
    assert resolve_config(None, grouped) == flat
    path = write(tmp_path, "schedule: {every: 50, max_interval: 30 min}\nalerts:\n  raise_on: wrong\ncoords: 4\n"
                           "logging: {log_dir: runs/x}\n", "grouped.yaml")
    assert load_config(path) == flat
    assert config_keys(path) == ["every", "max_interval", "raise_on", "coords", "log_dir"]
    inside = write(tmp_path, "epochs: 3\ngradwatch:\n  schedule:\n    every: 50\n  budget: {memory_budget: 0.2}\n  "
                             "check: null\n", "train.yaml")
    assert (load_config(inside).every, load_config(inside).memory_budget) == (50, 0.2)
    assert GradWatchConfig().to_dict().keys() == flat.to_dict().keys()  # records and validate stay flat: one name


def test_an_option_given_flat_and_in_its_group_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"^schedule\.every: given both flat \(every: 5\) and in schedule \(every: 50\); "
                                          r"give it once$"):
        GradWatchConfig().replace(every=5, schedule={"every": 50})
    with pytest.raises(ConfigError, match=r"^alerts\.raise_on: given both flat \(raise_on: 'wrong'\) and in alerts"):
        resolve_config(None, {"alerts": {"raise_on": "suspicious"}, "raise_on": "wrong"})
    path = write(tmp_path, "gradwatch:\n  every: 5\n  schedule: {every: 50}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: gradwatch\.schedule\.every: given both flat"):
        load_config(path)
    # a file's option and a keyword's are not a conflict: the keyword overrides
    assert resolve_config(write(tmp_path, "every: 5\n", "five.yaml"), {"schedule": {"every": 50}}).every == 50


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"schedule": {"evry": 5}}, r"^schedule\.evry: unknown option, did you mean 'every'\? \(schedule takes every, "
                                    r"overhead_budget, max_interval\)$"),
        ({"schedule": {"raise_on": "wrong"}}, r"^schedule\.raise_on: not an option of schedule, it is in alerts "
                                              r"\(schedule takes every, overhead_budget, max_interval\)$"),
        ({"alerts": 5}, r"^alerts: got 5, expected a mapping of its options \(alerts takes baseline_checks, "),
        ({"schedule": {"every": 0}}, r"^schedule\.every: got 0, expected an integer >= 1 or 'auto'$"),
        ({"schedul": {"every": 5}}, r"^schedul: unknown option, did you mean 'schedule'\? .*groups: check, schedule"),
    ],
)
def test_a_key_a_group_does_not_take_is_refused_with_the_ones_it_takes(options, pattern):
    with pytest.raises(ConfigError, match=pattern):
        GradWatchConfig().replace(**options)


def test_config_is_a_gradwatchconfig_or_a_yaml_path_with_keywords_overriding(tmp_path):
    base = GradWatchConfig(every=7, coords=3)
    assert resolve_config(base, {}) is base
    assert resolve_config(base, {"check": {"coords": 5}}) == GradWatchConfig(every=7, coords=5)
    path = write(tmp_path, "every: 7\ncoords: 3\n", "gw.yaml")
    assert resolve_config(path, None) == resolve_config(str(path)) == base
    assert resolve_config() == GradWatchConfig()
    with pytest.raises(ConfigError, match=r"^config: got dict, expected a GradWatchConfig or the path of a YAML config"):
        resolve_config({"every": 7})


def test_the_watch_takes_config_and_groups_as_every_front_end_does(tmp_path):
    from torch import nn

    from gradwatch import GradWatch

    model, loss_fn = nn.Linear(3, 1), lambda m, b: m(b).pow(2).sum()
    with GradWatch(model, loss_fn, schedule={"every": 50}, alerts={"raise_on": "wrong"}, jsonl=False,
                   tensorboard=False) as watch:
        assert (watch.config.every, watch.config.raise_on) == (50, "wrong")
        assert watch.policy.raise_on == "wrong"
    with GradWatch(model, loss_fn, config=GradWatchConfig(every=9), logging={"jsonl": False, "tensorboard": False}) as watch:
        assert watch.config.every == 9 and not watch.config.jsonl
    path = write(tmp_path, "schedule: {every: 9}\nlogging: {jsonl: false, tensorboard: false}\n", "gw.yaml")
    for config in (path, str(path)):
        with GradWatch(model, loss_fn, config=config, check={"coords": 2}) as watch:
            assert (watch.config.every, watch.config.coords, watch.config.jsonl) == (9, 2, False)
    with pytest.raises(ConfigError, match=r"^schedule\.every: given both flat"):
        GradWatch(model, loss_fn, every=5, schedule={"every": 50})


@pytest.mark.parametrize("off", ["off", "OFF", False, None, "null"])
def test_off_is_one_word_for_every_option_that_can_be_off(off):
    cfg = GradWatchConfig(raise_on=off, independence=off, pace=off, memory_budget=off, max_interval=off)
    assert all(getattr(cfg, name) is None for name in OFF_OPTIONS)
    assert all(cfg.to_dict()[name] == "off" for name in OFF_OPTIONS)
    assert GradWatchConfig.from_dict(cfg.to_dict()) == cfg
    assert GradWatchConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_yaml_off_and_the_defaults_that_are_off(tmp_path):
    text = "".join(f"{name}: off\n" for name in OFF_OPTIONS)  # YAML reads a bare off as false
    cfg = load_config(write(tmp_path, text, "off.yaml"))
    assert all(getattr(cfg, name) is None for name in OFF_OPTIONS)
    defaults = GradWatchConfig().to_dict()
    assert (defaults["raise_on"], defaults["max_interval"], defaults["independence"]) == ("off", "off", "auto")


@pytest.mark.parametrize("value, mode", [("auto", "auto"), ("off", "off"), ("Off", "off"), (False, "off"), (None, "off"),
                                         ("on", "on"), (True, "on")])
def test_distributed_takes_the_same_off(value, mode):
    from torch import nn

    from gradwatch import GradWatch

    assert parse_distributed(value) == mode
    if mode != "on":  # "on" needs an initialized process group (tests/parallel/test_distributed.py)
        with GradWatch(nn.Linear(2, 1), lambda m, b: m(b).sum(), distributed=value, jsonl=False, tensorboard=False) as w:
            assert w.dist is None


def test_distributed_refuses_other_words_naming_the_accepted_ones():
    with pytest.raises(ConfigError, match=r"^distributed: got 'yes', expected 'auto', 'on' or 'off'"):
        parse_distributed("yes")


@pytest.mark.parametrize("value", ["maybe", "excellent", "acceptable", 3, "off"])
def test_fail_at_and_raise_on_share_one_vocabulary_and_one_message(value):
    with pytest.raises(ConfigError) as fail_at:
        GradWatchConfig(fail_at=value)
    assert str(fail_at.value) == f"fail_at: got {value!r}, expected 'wrong' or 'suspicious'"
    if value != "off":
        with pytest.raises(ConfigError) as raise_on:
            GradWatchConfig(raise_on=value)
        assert str(raise_on.value) == f"raise_on: got {value!r}, expected 'off' (never), 'wrong' or 'suspicious'"
    for word in ("wrong", "SUSPICIOUS", " wrong "):
        assert GradWatchConfig(fail_at=word).fail_at == GradWatchConfig(raise_on=word).raise_on == word.strip().lower()
    assert CheckOptions(fail_at="Wrong").fail_at.value == "wrong"



def test_the_cli_reads_the_options_a_config_sets_in_its_groups(tmp_path, capsys):
    from gradwatch.cli import commands as cli

    path = write(tmp_path, "schedule: {every: 7}\ncoords: 3\n", "g.yaml")
    assert cli.main(["validate", str(path), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["set"] == ["every", "coords"] and (doc["options"]["every"], doc["options"]["coords"]) == (7, 3)


def test_the_hugging_face_callback_takes_config_as_the_watch_does(tmp_path):
    pytest.importorskip("transformers")
    from gradwatch.integrations.transformers import GradWatchCallback

    callback = GradWatchCallback(config=GradWatchConfig(every=4, coords=2), alerts={"raise_on": "wrong"})
    assert callback.config == GradWatchConfig(every=4, coords=2, raise_on="wrong")
    path = write(tmp_path, "gradwatch:\n  schedule: {every: 6}\n", "train.yaml")
    assert GradWatchCallback(config=path).config.every == 6
    with pytest.raises(ValueError, match=r"^GradWatchCallback: schedule\.every: given both flat"):
        GradWatchCallback(every=5, schedule={"every": 6})
