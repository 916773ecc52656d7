"""An unauthenticated caller of a head without a membership token learns only that membership is not
configured (issue 27, item 8): the token file's path is in the head's log, never in the 503 answer."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from omnistage_engine_patches import contract, membership_auth
from omnistage_engine_patches.membership_listing import MembershipError

SECRET_PATH = "/var/run/secrets/omnistage-tenant-a/membership/token"


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(membership_auth, "_token_cache", {"key": None, "token": None})


def _refusal(monkeypatch, caplog, **env: str) -> MembershipError:
    for name in (contract.TOKEN_FILE_ENV, contract.TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    request = SimpleNamespace(headers={"authorization": "Bearer guess"})
    with (
        caplog.at_level(logging.ERROR, logger=membership_auth.logger.name),
        pytest.raises(MembershipError) as err,
    ):
        membership_auth.authorize(request)
    return err.value


def test_an_unreadable_token_file_is_named_in_the_log_only(monkeypatch, caplog):
    err = _refusal(monkeypatch, caplog, **{contract.TOKEN_FILE_ENV: SECRET_PATH})
    assert (err.status, err.code) == (503, "TokenNotConfigured")
    answer = str(err.body())
    assert "omnistage-tenant-a" not in answer and contract.TOKEN_FILE_ENV not in answer, answer
    assert err.message == "membership is not configured on this head"
    assert SECRET_PATH in caplog.text  # the head's operator still finds out why


def test_no_token_at_all_says_the_same(monkeypatch, caplog):
    err = _refusal(monkeypatch, caplog)
    assert (err.status, err.message) == (503, "membership is not configured on this head")
    assert contract.TOKEN_FILE_ENV in caplog.text
    caplog.clear()
    _refusal(monkeypatch, caplog)  # the same cause again: logged once, not once per caller
    assert caplog.text == ""
