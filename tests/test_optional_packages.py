"""wandb, datasets, tensorboard and matplotlib are extras: without one, the feature that needs it is refused in
one line naming the flag or tool and the install command; everything else runs, and make setup installs all."""
from __future__ import annotations

import sys
import tomllib

import pytest

from megazero.arguments import parse_config
from megazero.data.preprocess_inputs import load_inputs
from megazero.training.run import validate
from tests.helpers.launch import ROOT
from tests.helpers.tool_module import load_tool

OPTIONAL = {"wandb", "datasets", "tensorboard", "matplotlib"}


def _blocked(monkeypatch, package: str) -> None:
    """Make ``package`` uninstalled for this test: the import system treats a None in sys.modules as absent."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


def test_the_extras_are_optional_and_make_setup_installs_them():
    project = tomllib.loads(open(f"{ROOT}/pyproject.toml").read())["project"]
    required = {dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in project["dependencies"]}
    assert not required & OPTIONAL, required & OPTIONAL
    extras = project["optional-dependencies"]
    assert set(extras["data"] + extras["wandb"] + extras["tensorboard"] + extras["plot"]) == OPTIONAL
    assert "megazero[all]" in extras["test"] and extras["all"] == ["megazero[data,wandb,tensorboard,plot]"]
    assert ".[test,lint]" in open(f"{ROOT}/Makefile").read()  # make setup: the test extra, so every extra


@pytest.mark.parametrize("package,flags,named", [
    ("wandb", ["--wandb-project", "p", "--wandb-mode", "offline"], "--wandb-project p"),
    ("tensorboard", ["--tensorboard-dir", "tb"], "--tensorboard-dir tb"),
])
def test_a_logging_flag_without_its_package_is_one_line_before_any_group(monkeypatch, package, flags, named):
    cfg, _ = parse_config(flags)
    validate(cfg, 1)  # installed: nothing to say
    _blocked(monkeypatch, package)
    with pytest.raises(ValueError) as err:
        validate(cfg, 1)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{named} needs the {package} package"), line
    assert f"pip install -e '.[{package}]'" in line, line


def test_a_run_without_the_logging_packages_still_validates(monkeypatch):
    for package in OPTIONAL:
        _blocked(monkeypatch, package)
    cfg, _ = parse_config(["--wandb-project", "p", "--wandb-mode", "disabled"])  # disabled: wandb never imported
    validate(cfg, 1)


def test_preprocessing_without_datasets_names_the_data_extra(monkeypatch, tmp_path):
    (tmp_path / "docs.txt").write_text("one document\n")
    _blocked(monkeypatch, "datasets")
    with pytest.raises(ValueError, match=r"tools/preprocess_data.py \(reading --input\) needs the datasets package.*"
                                         r"'\.\[data\]'"):
        load_inputs([str(tmp_path / "docs.txt")], "text", str(tmp_path / "cache"))


def test_plotting_without_matplotlib_names_the_plot_extra(monkeypatch, tmp_path, capsys):
    _blocked(monkeypatch, "matplotlib")
    plot = load_tool("plot_metrics")
    assert plot.main([str(tmp_path / "m.jsonl"), "--output", str(tmp_path / "m.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs the matplotlib package" in err and "'.[plot]'" in err, err
    assert not (tmp_path / "m.png").exists()
