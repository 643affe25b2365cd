"""How often rank 0 logs a ``step`` event: every 10 steps unless the script, the config or
``REGROUP_LOG_EVERY`` says otherwise (the script and the config first)."""

from __future__ import annotations

import pytest

from regroup.elastic.settings import ConfigError
from regroup.trainer.config_loading import config_from_dict
from regroup.elastic.options import options

COMMON = {"global_batch": 12, "max_steps": 100}


def test_a_script_logs_every_10_steps_by_default() -> None:
    assert options({}, **COMMON).log_every == 10
    assert config_from_dict({}, {}).log_every == 10


def test_the_environment_sets_the_default_and_the_script_or_config_overrides_it() -> None:
    env = {"REGROUP_LOG_EVERY": "1"}
    assert options(env, **COMMON).log_every == 1
    assert options(env, **COMMON, log_every=50).log_every == 50
    assert config_from_dict({}, env).log_every == 1
    assert config_from_dict({"log_every": 3}, env).log_every == 3


@pytest.mark.parametrize("value", ["0", "often"])
def test_a_bad_value_in_the_environment_is_refused_by_name(value: str) -> None:
    with pytest.raises(ConfigError, match="log_every"):
        options({"REGROUP_LOG_EVERY": value}, **COMMON)
