"""affinity.py, pure: prefix keys and sizes, the stable hash, the ring, bounded loads."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

from lowproxy.routing.affinity import (
    PREFIX_KEY_BYTES,
    Ring,
    choose_bounded,
    prompt_facts,
    stable_hash,
)


def chat_body(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for index, turn in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": turn})
    return {"model": "m", "messages": messages}


def test_the_hash_is_the_same_in_every_process():
    # Python's hash() of bytes is salted per process (PYTHONHASHSEED); this is not.
    code = "from lowproxy.routing.affinity import stable_hash; print(stable_hash(b'lowproxy'))"
    seen = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2")}
    assert seen == {str(stable_hash(b"lowproxy"))}
    assert stable_hash(b"abc") == int.from_bytes(
        hashlib.blake2b(b"abc", digest_size=8).digest(), "big")


def test_later_turns_of_a_conversation_keep_its_key():
    first = prompt_facts("chat", chat_body("You are a pirate.", "hello"))
    later = prompt_facts("chat", chat_body("You are a pirate.", "hello", "arr", "more?"))
    other = prompt_facts("chat", chat_body("You are a pirate.", "a different start"))
    assert first.key == later.key and first.key != other.key
    assert later.size == len("You are a pirate.hello" "arr" "more?")


def test_the_key_is_bounded_and_text_parts_count():
    long_system = "x" * (3 * PREFIX_KEY_BYTES)
    facts = prompt_facts("chat", chat_body(long_system, "hi"))
    assert facts.key is not None and len(facts.key) == PREFIX_KEY_BYTES
    assert facts.size == 3 * PREFIX_KEY_BYTES + 2
    parts = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "héllo"}, {"type": "image_url", "image_url": {"url": "u"}}]}]}
    assert prompt_facts("chat", parts).size == len("héllo".encode())


def test_completions_responses_messages_and_generate_have_keys():
    assert prompt_facts("completions", {"prompt": "abc"}).key == b"prompt\0abc\1"
    assert prompt_facts("completions", {"prompt": [1, 2, 3]}).size == 12
    assert prompt_facts("completions", {"prompt": ["a", "b"]}).key is None
    responses = prompt_facts("responses", {"instructions": "be brief", "input": "hi"})
    assert responses.key == b"system\0be brief\1user\0hi\1"
    messages = prompt_facts("messages", {"system": "sys", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    assert messages.key == b"system\0sys\1user\0q\1" and messages.size == 5
    assert prompt_facts("generate", {"token_ids": [5, 6]}).key is not None
    assert prompt_facts("chat", {"messages": "not a list"}) == (None, None)


def test_an_endpoint_leaving_moves_only_its_own_keys():
    names = [f"http://10.0.0.{i}:8000" for i in range(5)]
    before = Ring(names)
    after = Ring(names[:2] + names[3:])
    keys = [stable_hash(f"conversation {i}".encode()) for i in range(2000)]
    moved = 0
    for key in keys:
        home_before = next(before.order(key))
        home_after = next(after.order(key))
        if home_before != names[2]:
            assert home_after == home_before
        else:
            moved += 1
    assert 200 < moved < 600  # about a fifth of the keys were the leaver's


def test_replicas_build_the_same_ring_in_any_order():
    names = ["http://a:1", "http://b:1", "http://c:1"]
    one, two = Ring(names), Ring(list(reversed(names)))
    for i in range(100):
        key = stable_hash(str(i).encode())
        assert list(one.order(key)) == list(two.order(key))


def test_bounded_loads_hold_even_for_one_hot_key():
    names = [f"e{i}" for i in range(4)]
    ring = Ring(names)
    loads = dict.fromkeys(names, 0.0)
    hot = stable_hash(b"everyone's system prompt")
    spread_seen: set[str] = set()
    rng = random.Random(7)
    for step in range(2000):
        key = hot if step % 2 == 0 else rng.getrandbits(64)
        cost = float(rng.randint(1, 100))
        chosen = choose_bounded(ring, key, names, loads, cost, 0.25)
        assert chosen is not None
        least_before = min(loads.values())
        loads[chosen[0]] += cost
        average = sum(loads.values()) / len(loads)
        # Within the bound, or (a prompt larger than any room) the least loaded took it.
        assert (loads[chosen[0]] <= 1.25 * average + 1e-9
                or loads[chosen[0]] - cost == least_before)
        if step % 2 == 0:
            spread_seen.add(chosen[0])
        if rng.random() < 0.3:  # some requests end
            name = rng.choice(names)
            loads[name] = max(0.0, loads[name] - 50)
    assert len(spread_seen) > 1  # the hot key spilled: it cannot overload its home


def test_a_light_load_keeps_every_key_at_home():
    names = ["a", "b", "c"]
    ring = Ring(names)
    loads = {"a": 10.0, "b": 10.0, "c": 10.0}
    for i in range(50):
        key = stable_hash(str(i).encode())
        name, home = choose_bounded(ring, key, names, loads, 1.0, 0.25)  # type: ignore[misc]
        assert home and name == next(ring.order(key))


def test_an_overloaded_home_sends_the_key_on_and_says_so():
    ring = Ring(["a", "b"])
    key = stable_hash(b"k")
    home = next(ring.order(key))
    other = "b" if home == "a" else "a"
    chosen = choose_bounded(ring, key, ["a", "b"], {home: 100.0, other: 0.0}, 10.0, 0.25)
    assert chosen == (other, False)
    # Only eligible names are chosen; none eligible: no choice.
    assert choose_bounded(ring, key, [other], {}, 1.0, 0.25) == (other, True)
    assert choose_bounded(ring, key, [], {}, 1.0, 0.25) is None
