"""The data plane's API key: read from a file only, accepted beside the control token."""

from __future__ import annotations

import pytest

from stagemesh.core import auth, errors


def test_either_accepted_secret_passes_and_nothing_else_does():
    for secret in ("key-1", "token-2"):
        auth.check_bearer((("authorization", f"Bearer {secret}"),), "key-1", "token-2")
    for metadata, reason in (
        ((("authorization", "Bearer key-12"),), "invalid bearer token"),
        ((("authorization", "Basic key-1"),), "invalid bearer token"),
        ((("x-api-key", "key-1"),), "missing bearer token"),
    ):
        with pytest.raises(errors.Unauthenticated, match=reason):
            auth.check_bearer(metadata, "key-1", "token-2")


def test_the_key_comes_from_its_file_and_never_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    monkeypatch.setenv("STAGEMESH_API_KEY", "from-env")
    assert auth.load_api_key(None) is None
    path = tmp_path / "key"
    path.write_text("sk-local\n")
    path.chmod(0o600)
    assert auth.load_api_key(str(path)) == "sk-local"
    path.write_text("")
    with pytest.raises(errors.InvalidArgument, match="--api-key-file: API key file .* is empty"):
        auth.load_api_key(str(path))
    with pytest.raises(errors.InvalidArgument, match=r"\[gateway\] api_key_file: cannot read API key file"):
        auth.load_api_key(str(tmp_path / "absent"), "[gateway] api_key_file")


def test_the_data_plane_takes_the_key_as_a_bearer_or_as_x_api_key_and_the_token_as_a_bearer():
    for metadata in (
        (("authorization", "Bearer sk-1"),),
        (("x-api-key", "sk-1"),),
        (("authorization", "Bearer token-2"),),
        (("x-api-key", "stale"), ("authorization", "Bearer token-2")),
    ):
        auth.check_api_key(metadata, "sk-1", "token-2")
    for metadata, reason in (
        ((), "missing API key"),
        ((("authorization", "Bearer sk-12"),), "invalid API key"),
        ((("x-api-key", "token-2"),), "invalid API key"),  # the token only as a bearer
        ((("authorization", "Basic sk-1"),), "invalid API key"),
    ):
        with pytest.raises(errors.Unauthenticated, match=reason):
            auth.check_api_key(metadata, "sk-1", "token-2")


def test_no_key_installs_no_interceptor():
    assert auth.api_key_interceptors(None, {"/x/Generate"}, "token") == []
    assert len(auth.api_key_interceptors("key", {"/x/Generate"}, "token")) == 1
