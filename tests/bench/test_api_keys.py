"""`servelm bench run --api-keys voice=K1,code=K2`: each traffic class sends its own key (its
tenant on the server), the others the default; keys never reach the report or an error."""

from __future__ import annotations

import pytest

from servelm.bench.client import ClientConfig
from servelm.bench.execute import BenchConfig
from servelm.bench.profiles import parse_api_keys


def test_each_class_sends_its_own_key_and_the_rest_the_default():
    keys = parse_api_keys("voice=sk-v, code = sk-c")
    assert keys == {"voice": "sk-v", "code": "sk-c"}
    client = ClientConfig("http://x", api_key="sk-default", api_keys=keys)
    assert client.headers_for("voice") == {"Authorization": "Bearer sk-v"}
    assert client.headers_for("analytics") == {}  # the HTTP client's default header (sk-default) applies


def test_bad_specs_name_the_profile_and_never_the_key():
    with pytest.raises(ValueError, match="unknown profile 'vioce'") as error:
        parse_api_keys("vioce=sk-secret")
    assert "sk-secret" not in str(error.value)
    with pytest.raises(ValueError, match="profile 'code' has an empty key"):
        parse_api_keys("code=")


def test_the_report_says_which_keys_were_set_not_what_they_are(tmp_path):
    config = BenchConfig(base_url="http://x", out_dir=tmp_path, api_key="sk-default", api_keys={"voice": "sk-v"})
    reported = config.to_dict()
    assert reported["api_key"] == "(set)" and reported["api_keys"] == {"voice": "(set)"}
    assert "sk-" not in repr(reported)
