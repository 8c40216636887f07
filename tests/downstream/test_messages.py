"""What a handler sees of a request: the target split once, the hang-up watch on the read side."""

from __future__ import annotations

from lowproxy.downstream import ClientRequest


def test_the_target_is_split_into_path_and_query_once() -> None:
    request = ClientRequest(b"POST", b"/v1/completions?tag=1&x=%2F", [], b"", b"1.1")
    assert request.target == b"/v1/completions?tag=1&x=%2F"  # decode's, as received
    assert request.path_bytes == b"/v1/completions"  # prefill's target
    assert request.path == "/v1/completions"
    bare = ClientRequest(b"GET", b"/healthz", [], b"", b"1.1")
    assert (bare.path_bytes, bare.path) == (b"/healthz", "/healthz")


def test_watching_the_client_is_asked_of_the_request() -> None:
    watched: list[bool] = []
    request = ClientRequest(b"POST", b"/v1/x", [], b"", b"1.1", lambda: watched.append(True))
    request.watch_client()
    assert watched == [True]
    ClientRequest(b"GET", b"/", [], b"", b"1.1").watch_client()  # unwatched: a no-op
