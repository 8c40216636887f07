"""The pure parts of cache-aware routing: block chains, the index, rendezvous, the
engines' load reports."""

from __future__ import annotations

import random
import subprocess
import sys

from lowproxy.routing.blocks import chain_of, prompt_blocks
from lowproxy.routing.cache_aware import PrefixIndex, choose, label_salt, ranked, rendezvous
from lowproxy.routing.engine_load import parse_orca, parse_prometheus
from lowproxy.routing.placement import Placement


def chat(*texts: str) -> dict:
    return {"messages": [{"role": "user", "content": text} for text in texts]}


def test_a_next_turn_extends_the_chain_of_the_one_before():
    first = prompt_blocks("chat", chat("a" * 1000), 256)
    second = prompt_blocks("chat", chat("a" * 1000, "b" * 600), 256)
    assert len(first.chain) == 3 and second.chain[:3] == first.chain
    assert first.first == second.first and first.tokens == (1000 + 7) // 4 + 1
    assert prompt_blocks("embeddings", {}, 256).chain == []
    assert chain_of(b"ab" * 256, 256)[0] != chain_of(b"ab" * 256, 256)[1]  # depth counts
    ids = prompt_blocks("completions", {"prompt": list(range(200))}, 256)
    assert len(ids.chain) == 3  # 4 bytes per id


def test_cold_placement_inputs_are_the_same_in_every_process():
    body = chat("y" * 300, "z")
    code = ("from lowproxy.routing.blocks import prompt_blocks; "
            "from lowproxy.routing.cache_aware import "
            f"label_salt; print(prompt_blocks('chat', {body!r}, 256).first, "
            "label_salt('http://a:1'))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == f"{prompt_blocks('chat', body, 256).first} {label_salt('http://a:1')}"


def test_the_index_holds_prefixes_and_ages_tails_out_first():
    index = PrefixIndex(capacity=6)
    old = chain_of(b"o" * 1024, 256)  # 4 blocks
    index.record("p", old)
    assert index.match("p", old) == 4 and index.match("q", old) == 0
    new = chain_of(b"n" * 1024, 256)
    index.record("p", new)  # 8 blocks for 6 (+1) places: old's last two go
    assert index.match("p", new) == 4 and index.match("p", old) == 2
    longer = chain_of(b"n" * 1024 + b"m" * 512, 256)
    assert index.match("p", longer) == 4  # a longer prompt matches what is held


class _SortedIndex:
    """The index as it was: timestamps, a sort of them all every quarter over."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.held, self.tick = capacity, {}, 0

    def record(self, label: str, chain: list) -> None:
        held = self.held.setdefault(label, {})
        self.tick += 1
        held.update(zip(chain, range(self.tick << 20, -1, -1), strict=False))
        if len(held) > self.capacity + (self.capacity >> 2):
            kept = sorted(held.items(), key=lambda pair: pair[1])[-self.capacity:]
            self.held[label] = dict(kept)


def test_the_index_drops_what_a_sort_by_last_use_would():
    rng = random.Random(7)
    for trial in range(200):
        capacity = rng.randrange(1, 40)
        index, reference = PrefixIndex(capacity), _SortedIndex(capacity)
        prompts = [chain_of(bytes([65 + n]) * 256 * rng.randrange(1, 12), 256)
                   for n in range(rng.randrange(1, 12))]
        for _ in range(60):
            chain = rng.choice(prompts)
            chain = chain[:rng.randrange(1, len(chain) + 1)]  # a shorter turn, too
            label = rng.choice("pq")
            index.record(label, chain)
            reference.record(label, chain)
            for name in "pq":
                assert set(index.held.get(name, ())) == set(reference.held.get(name, ())), trial
                assert len(index.held.get(name, ())) <= capacity + (capacity >> 2)
                assert all(index.match(name, c) == sum(1 for _ in _held_prefix(
                    reference.held.get(name, {}), c)) for c in prompts)


def _held_prefix(held: dict, chain: list):
    for block in chain:
        if block not in held:
            return
        yield block


def test_rendezvous_moves_only_the_leaving_labels_prefixes():
    labels = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    salts = {label: label_salt(label) for label in labels}
    before = {first: rendezvous(labels, salts, first) for first in range(500)}
    assert len(set(before.values())) == 4
    after = {first: rendezvous(labels[1:], salts, first) for first in range(500)}
    assert all(after[f] == home for f, home in before.items() if home != labels[0])


def test_home_keeps_a_hit_until_its_queue_is_out_of_bounds():
    index = PrefixIndex(100)
    chain = chain_of(b"s" * 2048, 256)
    index.record("a", chain)
    salts = {"a": 1, "b": 2}

    def pick(work: dict) -> tuple:
        picked = choose(ranked(["a", "b"], salts, 0), index, chain, 600, 64, work, 0.25, 1000)
        return picked.label, picked.home

    assert pick({}) == ("a", True)
    assert pick({"a": 1500.0}) == ("a", True)  # within the allowance
    assert pick({"a": 6000.0}) == ("b", False)  # the queue outweighs the hit


def test_orca_reports_text_json_and_garbage():
    text = b"TEXT named_metrics.kv_cache_usage_perc=0.4, named_metrics.num_requests_waiting=3"
    assert parse_orca(text) == {"kv_usage": 0.4, "waiting": 3.0}
    assert parse_orca(b'JSON {"named_metrics": {"num_requests_waiting": 2}}') == {"waiting": 2}
    assert parse_orca(b"TEXT named_metrics.num_requests_waiting=nan, x") == {}
    assert parse_orca(b"JSON {not json") == {} and parse_orca(b"PROTO abc") == {}


def test_prometheus_of_vllm_and_sglang():
    vllm = ('# TYPE vllm:num_requests_waiting gauge\n'
            'vllm:num_requests_waiting{engine="0"} 2.0\n'
            'vllm:num_requests_waiting{engine="1"} 3.0\n'
            'vllm:num_requests_running{engine="0"} 7\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.75\n')
    assert parse_prometheus(vllm) == {"waiting": 5.0, "running": 7.0, "kv_usage": 0.75}
    sglang = 'sglang:num_queue_reqs{tp_rank="0"} 4\nsglang:token_usage{tp_rank="0"} 0.2\n'
    assert parse_prometheus(sglang) == {"waiting": 4.0, "kv_usage": 0.2}
    assert parse_prometheus("nothing here\n") == {}


def test_placement_spreads_a_group_above_its_share_and_balances_the_rest():
    labels = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    salts = {label: label_salt(label) for label in labels}
    placement = Placement(every=50, decay=1.0)
    for _ in range(16):
        placement.observe(7)  # a hot group: a third of the requests
    for group in range(100, 108):
        for _ in range(4):
            placement.observe(group)
    placement.observe(200)  # seen once: noise, not placed (MIN_COUNT)
    assert not placement.due()
    placement.observe(201)
    assert placement.due()
    placement.assign(labels, lambda group: ranked(labels, salts, group), 0.25)
    assert not placement.due() and 200 not in placement.homes
    hot = placement.homes[7]  # 16 of 50 requests, 15.6 per endpoint at most: two
    assert list(hot) == ranked(labels, salts, 7)[:2]
    load = dict.fromkeys(labels, 0.0)
    for group, homes in placement.homes.items():
        for label in homes:
            load[label] += (16 if group == 7 else 4) / len(homes)
    assert len(placement.homes) == 9 and max(load.values()) <= 1.25 * 50 / 4


def test_placement_keeps_a_group_where_it_already_is_while_it_fits():
    """The first assignment does not move a group off the endpoint that holds it
    (moving costs its prefix once more and the conversations it held), but one
    that would not fit there moves."""
    labels = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    salts = {label: label_salt(label) for label in labels}

    def order(group: int) -> list[str]:
        return ranked(labels, salts, group)

    def assigned(settle: bool) -> dict:
        placement = Placement(every=40, decay=1.0)
        for group in range(100, 110):
            for _ in range(4):
                placement.observe(group)
            if settle:  # each group went to the last endpoint of its order
                placement.settled(group, order(group)[-1])
        placement.assign(labels, order, 0.25)
        return placement.homes

    fresh, settled = assigned(False), assigned(True)
    moved = [group for group in fresh if fresh[group] != settled[group]]
    assert moved  # where a group is decides, not only its order
    # 40 requests, 4 per group: 12.5 per endpoint at most, three groups. Walked in
    # group order, a group stays unless three before it stayed there already.
    stayed = {label: 0 for label in labels}
    for group in range(100, 110):
        where = order(group)[-1]
        if stayed[where] < 3:
            assert settled[group] == (where,)
            stayed[where] += 1
        else:
            assert settled[group] != (where,)
    counts = {label: 0 for label in labels}
    for homes in settled.values():
        counts[homes[0]] += 1
    assert max(counts.values()) <= 3


def test_a_conversations_opening_is_the_same_every_turn_and_its_own():
    system = {"role": "system", "content": "s" * 2000}
    first = prompt_blocks("chat", {"messages": [system, {"role": "user", "content": "hi"}]}, 512)
    later = prompt_blocks("chat", {"messages": [
        system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"}]}, 512)
    other = prompt_blocks("chat", {"messages": [system, {"role": "user", "content": "ho"}]}, 512)
    assert first.opening() == later.opening() and first.opening() != other.opening()
    assert first.first == other.first  # one group: the same system prompt


def _choose_by_full_scan(order: list, index: PrefixIndex, chain: list, tokens: int,
                         block_tokens: int, work: dict, slack: float, allowance: float,
                         legs: dict, pinned: int) -> tuple:
    """choose() as it read before its shortcut: every endpoint matched and compared."""
    cap = 3.0 * (sum(legs.values()) + 1) / len(order) + 1 if legs else 0.0
    candidates = pinned or len(order)
    rows, home, longest = [], order[0], -1
    for position, label in enumerate(order):
        matched = index.match(label, chain)
        total = work.get(label, 0.0) + max(1, tokens - matched * block_tokens)
        rows.append((label, matched, total, not legs or legs.get(label, 0) + 1 <= cap))
        if position < candidates and matched > longest:
            home, longest = label, matched
    if not any(row[3] for row in rows):
        rows = [(label, matched, total, True) for label, matched, total, _ in rows]
    bound = (1.0 + slack) * min(row[2] for row in rows if row[3]) + allowance
    home_row = next(row for row in rows if row[0] == home)
    if home_row[3] and home_row[2] <= bound:
        return home, longest, True
    label, matched, _, _ = next(row for row in rows if row[3] and row[2] <= bound)
    return label, matched, False


def test_the_shortcut_choice_is_the_full_comparisons_choice():
    rng = random.Random(22)
    labels = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    prompts = [chain_of(bytes([n]) * 256 * rng.randint(1, 12), 256) for n in range(12)]
    for _ in range(3000):
        index = PrefixIndex(40)
        for _ in range(rng.randint(0, 8)):
            index.record(rng.choice(labels), rng.choice(prompts)[:rng.randint(1, 12)])
        order = rng.sample(labels, rng.randint(1, 4))
        chain = rng.choice(prompts)
        tokens = len(chain) * 64 + rng.randint(0, 63)
        # Every label's work, as the router passes it, or only some (missing: none queued).
        work = {label: float(rng.choice((0, 100, 2000, 9000))) for label in order
                if rng.random() < 0.8}
        legs = {label: rng.randint(0, 6) for label in order if rng.random() < 0.7}
        pinned = rng.randint(0, len(order))
        args = (order, index, chain, tokens, 64, work, 0.25, rng.choice((0.0, 1000.0, 4096.0)),
                legs, pinned)
        assert tuple(choose(*args)) == _choose_by_full_scan(*args)
