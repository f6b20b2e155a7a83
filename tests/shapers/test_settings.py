"""The `shapers` section (`shapers.settings`): parsed from the command line option by option, from a config's or a
checkpoint's nested dicts, each shaper off unless given, every value checked in one line."""

from __future__ import annotations

import pytest
from jsonargparse import ArgumentParser

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.shapers.settings import CustomShaper, OARSettings, ShaperSettings, THRSettings


def parsed(*flags: str) -> ShaperSettings:
    """The section as LightningCLI's parser (jsonargparse) builds it from flags."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--shapers", type=ShaperSettings, default=ShaperSettings())
    return parser.instantiate_classes(parser.parse_args(list(flags))).shapers


def test_each_option_is_a_flag_and_a_shaper_is_off_unless_given():
    assert parsed() == ShaperSettings() and ShaperSettings().names() == ()
    s = parsed("--shapers.thr.p", "-0.2", "--shapers.oar.method", "perturbation", "--shapers.oar.chunk_size", "4")
    assert s.thr == THRSettings(p=-0.2) and s.oar == OARSettings(method="perturbation", chunk_size=4)
    assert s.names() == ("model.shapers.thr", "model.shapers.oar")
    assert parsed("--shapers.thr.p", "0.2", "--shapers.thr", "null").thr is None  # a preset's THR turned off
    custom = parsed("--shapers.custom", "[{name: my_pkg.Shaper, knobs: {a: 1}}]")
    assert custom.custom == [CustomShaper("my_pkg.Shaper", {"a": 1})]
    assert custom.names() == ("model.shapers.custom=my_pkg.Shaper",)


def test_an_option_a_shaper_does_not_have_is_a_parse_error():
    with pytest.raises(Exception, match="Option 'pp' is not accepted"):
        parsed("--shapers.thr.pp", "0.2")


def test_the_section_from_nested_dicts_round_trips_and_unknown_keys_are_one_line():
    s = ShaperSettings(thr=THRSettings(p=0.3), custom=[CustomShaper("a.B", {"k": 2})])
    from dataclasses import asdict

    assert ShaperSettings.of(asdict(s)) == s and ShaperSettings.of(None) == ShaperSettings()
    with pytest.raises(ConfigError, match=r"^model.shapers: unknown shaper 'thx'; valid: custom, oar, thr$"):
        ShaperSettings.of({"thx": {}})
    with pytest.raises(ConfigError, match=r"^model.shapers.oar: .*'qq'.*; its options are method, readout, q, "):
        ShaperSettings.of({"oar": {"qq": 1}})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"thr": {"p": 1.5}}, r"model.shapers.thr.p=1.5 must lie in \[-1, 1\]"),
        ({"thr": {"threshold": "absolute"}}, r"model.shapers.thr.threshold=absolute needs model.shapers.thr.thr_abs"),
        ({"thr": {"quantile": 1.0}}, r"model.shapers.thr.quantile=1.0 must lie in \(0, 1\)"),
        ({"oar": {"floor": 0.0}}, r"model.shapers.oar needs 0 < q < 1, beta ≥ 0, 0 < floor ≤ 1"),
        ({"oar": {"readout": "first"}}, r"model.shapers.oar.readout"),
        ({"custom": [{"name": "Shaper"}]}, r"model.shapers.custom: name='Shaper' is not the dotted path of a class"),
    ],
    ids=["thr-p", "thr-absolute", "thr-quantile", "oar-floor", "oar-readout", "custom-name"],
)
def test_a_value_out_of_range_is_one_error_line(section, message):
    with pytest.raises(ConfigError, match="^" + message):
        ShaperSettings.of(section).check()
