"""Pure parts of PD_PROXY_PEERS: the batch encoding, the block keys every process computes
alike, and endpoint labels that replicas configured alike share."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from lowproxy.config import parse_endpoint
from lowproxy.routing.blocks import chain_of, hash_probe, prompt_blocks, stable_chain_of
from lowproxy.routing.peer_batch import MAGIC, BatchError, decode, encode
from lowproxy.upstream.endpoint import Endpoint

RECORDS = [("http://127.0.0.1:9000", [1, -2, 2**63 - 1, -(2**63)]),
           ("http://[::1]:9001", [7]),
           ("http://127.0.0.1:9000", [3, 4])]


def test_a_batch_reads_back_as_it_was_written():
    raw = encode(2**64 - 1, -5, 512, RECORDS)
    batch = decode(raw)
    assert (batch.replica, batch.probe, batch.block_bytes) == (2**64 - 1, -5, 512)
    assert [(label, list(chain)) for label, chain in batch.records] == RECORDS
    assert decode(encode(1, 2, 3, [])).records == []
    # 8 bytes a key, 4 a record, the labels once: 7 keys, 3 records, 2 labels.
    assert len(raw) == struct.calcsize("<4sQqIHII") + 7 * 8 + 3 * 4 + 2 * 2 + 21 + 17


@pytest.mark.parametrize("mangle, why", [
    (lambda raw: raw[:10], "too short"),
    (lambda raw: b"XXXX" + raw[4:], "magic"),
    (lambda raw: raw[:-1], "size"),
    (lambda raw: raw + b"\0" * 8, "size"),
    (lambda raw: raw[:34], "label"),
])
def test_a_bad_body_is_a_batch_error(mangle, why):
    with pytest.raises(BatchError, match=why):
        decode(mangle(encode(1, 2, 512, RECORDS)))


def test_counts_that_do_not_add_up_are_refused():
    head = struct.Struct("<4sQqIHII")
    label = b"http://a:1"
    body = struct.pack("<H", len(label)) + label
    # one record naming label 3 of 1
    raw = head.pack(MAGIC, 1, 2, 512, 1, 1, 1) + body + struct.pack("<HHq", 3, 1, 9)
    with pytest.raises(BatchError, match="names no label"):
        decode(raw)
    # a chain of 2 keys, with 1 key sent
    raw = head.pack(MAGIC, 1, 2, 512, 1, 1, 1) + body + struct.pack("<HHq", 0, 2, 9)
    with pytest.raises(BatchError, match="add up"):
        decode(raw)
    raw = head.pack(MAGIC, 1, 2, 512, 5000, 0, 0)
    with pytest.raises(BatchError, match="labels"):
        decode(raw)


DATA = ("system\0" + "the shared system prompt " * 80 + "\1user\0a question\1").encode()


def _keys_elsewhere(seed: str) -> str:
    code = ("from lowproxy.routing.blocks import stable_chain_of, hash_probe; "
            f"print(stable_chain_of({DATA!r}, 256), hash_probe(512))")
    env = {**os.environ, "PYTHONHASHSEED": seed}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env).stdout.strip()


def test_stable_keys_are_the_same_in_every_process_whatever_its_hash_seed():
    here = f"{stable_chain_of(DATA, 256)} {hash_probe(512)}"
    assert _keys_elsewhere("1") == here == _keys_elsewhere("2")
    # Python's own hash() of bytes differs between those processes: not used here.
    salted = "import sys; print(hash(sys.argv[1].encode()))"
    runs = {subprocess.run([sys.executable, "-c", salted, "x" * 40], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}
                           ).stdout for seed in ("1", "2")}
    assert len(runs) == 2


def test_stable_keys_chain_as_the_process_keys_do():
    keys = stable_chain_of(DATA, 256)
    assert len(keys) == len(DATA) // 256 == len(chain_of(DATA, 256))
    longer = stable_chain_of(DATA + b"more" * 200, 256)
    assert longer[:len(keys)] == keys  # a next turn extends the chain
    assert stable_chain_of(b"ab" * 256, 256)[0] != stable_chain_of(b"ab" * 256, 256)[1]
    swapped = stable_chain_of(DATA[256:512] + DATA[:256], 256)
    assert swapped[1] != keys[1]  # the order of blocks counts
    assert all(-(2**63) <= key < 2**63 for key in keys)  # 64 bits: the batch's i64
    body = {"messages": [{"role": "user", "content": "q" * 2000}]}
    assert prompt_blocks("chat", body, 256, stable=True).chain == \
        stable_chain_of(b"user\0" + b"q" * 2000 + b"\1", 256)
    assert hash_probe(512) != hash_probe(256)


def test_replicas_configured_alike_label_endpoints_alike():
    # Static URLs: what the operator wrote, normalised; two replicas' configs compare.
    written = ["http://Prefill-0.Example:8000/", "http://prefill-0.example:8000"]
    labels = {Endpoint(parse_endpoint(text)).label for text in written}
    assert labels == {"http://prefill-0.example:8000"}
    # dns+ names: each discovered endpoint is labelled by the address it resolved to.
    spec = parse_endpoint("dns+http://prefill.ns.svc:8000")
    assert Endpoint(spec, "10.1.2.3").label == "http://10.1.2.3:8000"
    assert Endpoint(spec, "fd00::1").label == "http://[fd00::1]:8000"
