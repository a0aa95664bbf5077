"""Selection rules of the Hugging Face passes: resolution order, override precedence, pattern safety."""

from __future__ import annotations

import pytest

from bitpress.errors import OptionError
from bitpress.hf.rules import Rules, Settings
from bitpress_kquant.hf_passes import KQuantHfPass
from bitpress_rtn.hf_passes import RtnHfPass

DEFAULTS = Settings(4, 32, True)
ALL_ON = {"lm_head": True, "embeds": True, "moe": True}
Q_PROJ = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj.weight")
HEAD = ("lm_head", "lm_head.weight")


def rules(flags=None, not_convert=(), overrides=None) -> Rules:
    return Rules(DEFAULTS, dict(flags if flags is not None else ALL_ON), list(not_convert), dict(overrides or {}))


def test_defaults_apply_when_nothing_else_matches() -> None:
    d = rules().resolve(Q_PROJ, "linear")
    assert d.settings == DEFAULTS and d.reason == "pass defaults"


def test_modules_to_not_convert_wins_over_overrides_and_matches_substrings() -> None:
    r = rules(not_convert=["self_attn"], overrides={"model.layers.0.self_attn.q_proj": {"bits": 8}})
    d = r.resolve(Q_PROJ, "linear")
    assert d.settings is None and "modules_to_not_convert" in d.reason
    # a re: entry must match the whole name
    assert rules(not_convert=["re:self_attn"]).resolve(Q_PROJ, "linear").settings is not None
    assert rules(not_convert=[r"re:.*\.q_proj"]).resolve(Q_PROJ, "linear").settings is None


def test_category_flags_are_hard_excludes_that_overrides_cannot_reinclude() -> None:
    r = rules(flags={"lm_head": False, "embeds": False, "moe": False}, overrides={"lm_head": {"bits": 8}})
    d = r.resolve(HEAD, "lm_head")
    assert d.settings is None and "lm_head" in d.reason
    assert rules(flags={**ALL_ON, "embeds": False}).resolve(("model.embed_tokens",), "embeds").settings is None
    assert rules(flags={**ALL_ON, "moe": False}).resolve(("model.layers.0.mlp.experts",), "moe").settings is None
    # with the flag on, the same override applies
    assert rules(overrides={"lm_head": {"bits": 8}}).resolve(HEAD, "lm_head").settings == Settings(8, 32, True)


def test_not_convert_comes_before_the_category_flags() -> None:
    d = rules(flags={"lm_head": False}, not_convert=["lm_head"]).resolve(HEAD, "lm_head")
    assert "modules_to_not_convert" in d.reason


def test_overrides_first_match_in_insertion_order_wins_not_the_most_specific() -> None:
    broad = r"re:model\.layers\..*"
    exact = "model.layers.0.self_attn.q_proj"
    first = rules(overrides={broad: {"bits": 8}, exact: {"bits": 2}}).resolve(Q_PROJ, "linear")
    assert first.settings == Settings(8, 32, True) and "re:model" in first.reason
    second = rules(overrides={exact: {"bits": 2}, broad: {"bits": 8}}).resolve(Q_PROJ, "linear")
    assert second.settings == Settings(2, 32, True)


def test_plain_override_keys_are_literal_not_substrings_or_globs() -> None:
    r = rules(overrides={"q_proj": {"bits": 8}, "model.layers.*": {"bits": 8}})
    assert r.resolve(Q_PROJ, "linear").settings == DEFAULTS
    # the parameter name matches too (fused experts are named by their parameter)
    assert rules(overrides={"model.layers.0.self_attn.q_proj.weight": {"bits": 8}}).resolve(
        Q_PROJ, "linear").settings == Settings(8, 32, True)


def test_override_settings_fall_back_to_the_defaults_and_accept_sym_or_symmetric() -> None:
    r = rules(overrides={"lm_head": {"group_size": 64, "sym": False}})
    assert r.resolve(HEAD, "lm_head").settings == Settings(4, 64, False)
    r = rules(overrides={"lm_head": {"symmetric": False}})
    assert r.resolve(HEAD, "lm_head").settings == Settings(4, 32, False)


@pytest.mark.parametrize(("pattern", "hits"), [("re:(a+)+", True), ("re:(.*)*x", False), (r"re:(\w+\s?)+$", True),
                                             ("re:(a|aa)+(b*)*", True), ("re:(a|aa)*c", False)])
@pytest.mark.parametrize("where", ["overrides", "modules_to_not_convert"])
def test_backtracking_prone_patterns_match_in_linear_time(pattern: str, hits: bool, where: str) -> None:
    """RE2 matches them without backtracking: accepted, and exact on long names (the wall-clock
    guard against a hang is tests/test_config_hardening.py's subprocess timeout)."""
    value = {pattern: {"bits": 8}} if where == "overrides" else [pattern]
    rules = RtnHfPass.from_config({where: value}).options.rules()
    decision = rules.resolve(("a" * 5000,), "linear")
    if where == "overrides":
        assert (decision.settings == Settings(8, 128, True)) is hits
    else:
        assert (decision.settings is None) is hits


@pytest.mark.parametrize(("pattern", "why"), [(r"re:(a)\1", "backreference"), ("re:x(?=y)", "lookahead"),
                                             ("re:(?<!x)y", "negative lookbehind"), ("re:a{1,1001}", "at most 1000")])
@pytest.mark.parametrize("where", ["overrides", "modules_to_not_convert"])
def test_patterns_re2_cannot_express_are_refused_when_options_are_parsed(pattern: str, why: str, where: str) -> None:
    value = {pattern: {"bits": 8}} if where == "overrides" else [pattern]
    with pytest.raises(OptionError, match=why):
        RtnHfPass.from_config({where: value})


def test_overlong_and_invalid_patterns_are_refused() -> None:
    with pytest.raises(OptionError, match="longer than"):
        RtnHfPass.from_config({"overrides": {"re:" + "a" * 600: {"bits": 8}}})
    with pytest.raises(OptionError, match="not a valid regular expression"):
        RtnHfPass.from_config({"modules_to_not_convert": ["re:(unclosed"]})


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"bits": 3}, "bits must be one of 2, 4, 8"), ({"group_size": 48}, "power of two"),
     ({"block_size": 32}, "unknown key"), ({"sym": True, "symmetric": False}, "disagree"), ("8", "mapping")],
)
def test_bad_override_values_are_refused(settings: object, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        KQuantHfPass.from_config({"overrides": {"lm_head": settings}})


def test_precisions_set_bits_and_pass_metadata() -> None:
    for precision, bits in (("int2", 2), ("int4", 4), ("int8", 8)):
        assert RtnHfPass.from_config({}, precision).options.bits == bits
    with pytest.raises(OptionError, match="contradicts"):
        RtnHfPass.from_config({"bits": 8}, "int4")
    assert RtnHfPass.model_kinds == ("hf",) and "rtn" in RtnHfPass.algorithms and "Rtn" in RtnHfPass.aliases
    assert KQuantHfPass.model_kinds == ("hf",) and "kquant" in KQuantHfPass.algorithms
    assert "KQuant" in KQuantHfPass.aliases
    defaults = RtnHfPass.from_config({}).options
    assert (defaults.lm_head, defaults.embeds, defaults.moe) == (False, False, False)
