import subprocess
import sys

import pytest

from threefold.config import PRESETS, Config, build_config, describe, parse_overrides
from threefold.errors import ConfigError
from threefold.validate import validate


def cfg_with(*pairs, world=None):
    return validate(build_config(None, list(pairs)), world)


def test_defaults_fill_from_preset():
    cfg = cfg_with()
    assert cfg.model.preset == "tiny"
    for key, value in PRESETS["tiny"].items():
        assert getattr(cfg.model, key) == value
    assert cfg.parallel.microbatches == cfg.train.global_batch // cfg.train.micro_batch


def test_override_types_and_both_spellings():
    pairs = parse_overrides(["--parallel.dp", "2", "--train.lr=0.01", "--parallel.sp", "false"])
    assert pairs == [("parallel.dp", "2"), ("train.lr", "0.01"), ("parallel.sp", "false")]
    cfg = build_config(None, pairs)
    assert cfg.parallel.dp == 2 and cfg.train.lr == 0.01 and cfg.parallel.sp is False


def test_a_value_given_beats_the_preset_even_when_it_is_the_default():
    cfg = build_config(None, [("model.preset", "olmoe-1b-7b"), ("model.top_k", "2")])
    assert cfg.model.top_k == 2 and cfg.model.num_experts == 64  # 2 is top_k's default; 64 from the preset
    assert build_config(None, [("model.preset", "olmoe-1b-7b")]).model.top_k == 8


def test_explicit_shape_beats_preset():
    cfg = cfg_with(("model.preset", "small"), ("model.layers", "2"))
    assert cfg.model.layers == 2 and cfg.model.hidden == PRESETS["small"]["hidden"]


def test_an_mha_preset_stays_mha_when_its_heads_change():
    model = build_config(None, [("model.preset", "gpt-175b"), ("model.heads", "160")]).model
    assert model.heads == model.kv_heads == 160
    assert build_config(None, [("model.preset", "llama-70b"), ("model.heads", "128")]).model.kv_heads == 8  # GQA keeps
    pairs = [("model.preset", "gpt-175b"), ("model.heads", "160"), ("model.kv_heads", "8")]
    assert build_config(None, pairs).model.kv_heads == 8  # a kv_heads given wins
    out = subprocess.run(
        [sys.executable, "-m", "threefold", "plan", "--model.preset", "gpt-175b", "--model.heads", "160",
         "--model.hidden", "25600", "--train.global_batch", "1536", "--cluster.nodes", "128"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "kv_heads" not in out.stderr and out.returncode == 0, out.stderr


def test_toml_then_command_line(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nsteps = 7\nlr = 0.5\n[parallel]\ndp = 2\n")
    cfg = build_config(str(f), [("train.steps", "9")])
    assert (cfg.train.steps, cfg.train.lr, cfg.parallel.dp) == (9, 0.5, 2)


@pytest.mark.parametrize(
    "pairs, key, fragment",
    [
        ([("parallel.tp", "3")], "parallel.tp", "not divisible"),
        ([("parallel.tpp", "2")], "parallel.tpp", "did you mean 'parallel.tp'"),
        ([("parallel.dp", "two")], "parallel.dp", "not a valid int"),
        ([("parallel.schedule", "zigzag")], "parallel.schedule", "valid: gpipe"),
        ([("model.preset", "huge")], "model.preset", "valid: tiny"),
        ([("parallel.sp", "true")], "parallel.sp", "needs tensor parallelism"),
        ([("train.global_batch", "10"), ("parallel.dp", "4")], "train.global_batch", "not divisible"),
        ([("model.kv_heads", "3")], "model.kv_heads", "not divisible"),
        ([("train.micro_batch", "3")], "train.micro_batch", "not divisible"),
    ],
)
def test_bad_values_name_the_key(pairs, key, fragment):
    with pytest.raises(ConfigError) as info:
        cfg_with(*pairs)
    assert info.value.key == key
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_world_size_must_match_degrees():
    with pytest.raises(ConfigError, match="torchrun started 4 processes"):
        cfg_with(("parallel.dp", "2"), world=4)
    assert cfg_with(("parallel.dp", "0"), world=4).parallel.dp == 4


def test_unknown_section_and_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown section"):
        cfg_with(("trian.steps", "3"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(str(bad), [])
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(str(tmp_path / "missing.toml"), [])


def test_every_field_has_a_doc():
    text = describe()
    for line in text.splitlines():
        if line.startswith("  "):
            assert "#" in line and line.split("#", 1)[1].strip(), line


def test_round_trip_through_dict():
    cfg = cfg_with(("parallel.dp", "2"))
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_cli_prints_one_line_and_exits_2():
    out = subprocess.run(
        [sys.executable, "-m", "threefold", "train", "--parallel.tp", "3"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.tp" in lines[0] and "valid: 1, 2, 4" in lines[0]
    assert out.stdout == ""
