"""Config loading refuses bad input by key name; overrides parse as TOML literals."""

import pytest

from strop.config import Config, load_config, to_toml
from strop.errors import UserError


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[midtrain]\nsteps = 7\n[data]\ndirs = ["a", "b"]\n')
    cfg = load_config(f, ["midtrain.lr=0.5", "run.name=abc", "model.arch=deepseek_v3"])
    assert isinstance(cfg, Config)
    assert (cfg.midtrain.steps, cfg.midtrain.lr, cfg.run.name, cfg.data.dirs) == (7, 0.5, "abc", ["a", "b"])
    assert cfg.model.arch == "deepseek_v3"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["midtrain.stepz=3"], "midtrain.stepz"),
        (["nosection.x=1"], "nosection"),
        (['midtrain.steps="ten"'], "midtrain.steps"),
        (["midtrain.steps=0"], "must be >="),
        (["midtrain.lr=true"], "midtrain.lr"),
        (["model.arch=llama"], "model.arch"),
        (["data.dirs=3"], "data.dirs"),
        (["novalue"], "key=value"),
        (["rl.lr=inf"], "rl.lr.*not a finite number"),
        (["rl.lr=nan"], "rl.lr.*not a finite number"),
        (["rollout.temperature=-inf"], "not a finite number"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message if ".*" in message else message.replace(".", r"\.")):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        load_config(latin1)
    with pytest.raises(UserError, match="is a directory"):
        load_config(tmp_path)


def test_toml_roundtrip(tmp_path):
    cfg = load_config(None, ["data.dirs=['x']", "run.name=r"])
    f = tmp_path / "out.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg
