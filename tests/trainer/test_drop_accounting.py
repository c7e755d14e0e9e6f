"""The drop accounting against deliberately naive counts (loops over tokens) and against
Megatron-Core's own ``apply_router_token_dropping``."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from runledger.trainer import drop_accounting as da

# --- independent, naive counts ---------------------------------------------------------------------


def naive_capacity_dropped(assignments: list[list[int]], num_experts: int, top_k: int, cf: float) -> int:
    """Walk the tokens in order; each expert accepts until it holds ceil(T·k/E·cf) (Megatron's float
    formula, written out again here)."""
    tokens = len(assignments)
    capacity = math.ceil(tokens * top_k / num_experts * cf)
    held = [0] * num_experts
    dropped = 0
    for experts in assignments:
        for e in experts:
            if held[e] < capacity:
                held[e] += 1
            else:
                dropped += 1
    return dropped


def naive_pooled_wave(
    assignments: list[list[int]],
    num_experts: int,
    top_k: int,
    shards: int,
    waves: int,
    cf: float,
    senders: int | None = None,
) -> tuple[int, int]:
    """Sender by sender, token by token, expert id by expert id: deal each destination's
    assignments round-robin over waves, send while the wave's pool has room, then count arrivals
    per (destination expert, wave) against the slots (sized for the senders present)."""
    senders = shards if senders is None else senders
    tokens = len(assignments)
    per_sender = tokens // senders
    local = num_experts // shards
    a = per_sender * top_k
    pool = math.ceil(Fraction(str(cf)) * a / (shards * waves))
    # Expected arrivals per expert and wave: senders · a / (experts · waves); cf times that.
    slots = math.ceil(Fraction(str(cf)) * senders * a / (num_experts * waves))
    arrivals: dict[tuple[int, int], int] = {}
    sender_drops = 0
    for s in range(senders):
        dealt = [0] * shards  # assignments seen per destination
        sent = [[0] * waves for _ in range(shards)]
        for t in range(s * per_sender, (s + 1) * per_sender):
            for e in sorted(assignments[t]):
                d = e // local
                w = dealt[d] % waves
                dealt[d] += 1
                if sent[d][w] < pool:
                    sent[d][w] += 1
                    arrivals[(e, w)] = arrivals.get((e, w), 0) + 1
                else:
                    sender_drops += 1
    receiver_drops = sum(max(0, n - slots) for n in arrivals.values())
    return sender_drops, receiver_drops


def as_selection(assignments: list[list[int]], num_experts: int) -> torch.Tensor:
    sel = torch.zeros(len(assignments), num_experts, dtype=torch.bool)
    for t, experts in enumerate(assignments):
        sel[t, experts] = True
    return sel


def random_assignments(
    gen: torch.Generator, tokens: int, num_experts: int, top_k: int, skew: float
) -> list[list[int]]:
    """Top-k without replacement from a skewed (Zipf-like) distribution: an unbalanced router."""
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    picks = torch.multinomial(weights.expand(tokens, -1), top_k, replacement=False, generator=gen)
    return picks.tolist()


# --- Megatron's per-micro-batch capacity -----------------------------------------------------------


@pytest.mark.parametrize("cf", [0.3, 1.0, 1.15, 1.25, 1.5, 2.0, 1000.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_capacity_matches_the_naive_count(cf: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens, experts, k = 97, 16, 3  # T·k = 291: not divisible by E
    assignments = random_assignments(gen, tokens, experts, k, skew=0.8 + seed * 0.4)
    sel = as_selection(assignments, experts)
    assert da.capacity_dropped(sel, k, cf) == naive_capacity_dropped(assignments, experts, k, cf)


def test_capacity_edge_cases() -> None:
    experts, k = 8, 2
    all_to_one = [[0, 1]] * 40  # every token picks experts 0 and 1
    sel = as_selection(all_to_one, experts)
    cap = math.ceil(40 * 2 / 8 * 1.0)  # 10
    assert (
        da.capacity_dropped(sel, k, 1.0)
        == 2 * (40 - cap)
        == naive_capacity_dropped(all_to_one, experts, k, 1.0)
    )
    assert da.capacity_dropped(sel, k, 1e6) == 0  # capacity beyond T: Megatron drops nothing
    assert da.capacity_dropped(sel[:0], k, 1.0) == 0  # no tokens
    # A perfectly balanced micro-batch drops nothing at cf 1.
    balanced = [[(2 * t) % experts, (2 * t + 1) % experts] for t in range(32)]
    assert da.capacity_dropped(as_selection(balanced, experts), k, 1.0) == 0


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.15, 2.0])
def test_keep_mask_is_megatrons_own(policy: str, cf: float) -> None:
    """The kept assignments equal those of Megatron-Core's apply_router_token_dropping."""
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    gen = torch.Generator().manual_seed(7)
    tokens, experts, k = 64, 8, 2
    logits = torch.randn(tokens, experts, generator=gen) + torch.linspace(0, 2, experts)
    probs_all = torch.softmax(logits, dim=-1)
    top = torch.topk(probs_all, k, dim=-1).indices
    sel = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = probs_all * sel
    _, megatron_map = apply_router_token_dropping(probs, sel, k, cf, drop_policy=policy)
    ours = da.capacity_keep_mask(sel, probs, k, cf, policy)  # type: ignore[arg-type]
    assert int(sel.sum() - ours.sum()) == da.capacity_dropped(sel, k, cf)
    if policy == "probs":  # distinct probabilities: the same assignments, not just the same count
        assert torch.equal(ours, megatron_map)
    else:  # "position": Megatron's topk over equal ints may pick any; the count per expert is fixed
        assert torch.equal(ours.sum(0), megatron_map.sum(0))


def test_unknown_policy_is_refused() -> None:
    sel = as_selection([[0, 1]] * 8, 4)
    with pytest.raises(ValueError, match="unknown drop policy"):
        da.capacity_keep_mask(sel, sel.float(), 2, 0.5, "random")  # type: ignore[arg-type]


# --- pooled-wave ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "shards", "waves"),
    [(96, 16, 4, 4, 3), (60, 12, 2, 6, 3), (64, 8, 3, 8, 2), (40, 8, 2, 1, 3), (48, 16, 5, 16, 3)],
)
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.15, 2.0])
def test_pooled_wave_matches_the_naive_count(
    tokens: int, experts: int, k: int, shards: int, waves: int, cf: float
) -> None:
    gen = torch.Generator().manual_seed(tokens * 31 + shards)
    assignments = random_assignments(gen, tokens, experts, k, skew=1.0)
    got = da.pooled_wave_dropped(
        as_selection(assignments, experts), k, shards=shards, waves=waves, capacity_factor=cf
    )
    assert (got.sender, got.receiver) == naive_pooled_wave(assignments, experts, k, shards, waves, cf)


@pytest.mark.parametrize(("senders", "shards"), [(1, 16), (2, 8), (3, 4), (1, 1)])
@pytest.mark.parametrize("cf", [1.0, 1.15, 2.0])
def test_fewer_senders_than_shards(senders: int, shards: int, cf: float) -> None:
    """64-way expert parallelism accounted for from one rank's tokens: senders ≠ shards."""
    gen = torch.Generator().manual_seed(senders * 100 + shards)
    assignments = random_assignments(gen, 96, 16, 4, skew=0.9)
    got = da.pooled_wave_dropped(
        as_selection(assignments, 16), 4, shards=shards, waves=3, capacity_factor=cf, senders=senders
    )
    want = naive_pooled_wave(assignments, 16, 4, shards, 3, cf, senders)
    assert (got.sender, got.receiver) == want


def test_pooled_wave_edge_cases() -> None:
    experts, k, shards, waves = 8, 2, 4, 3
    all_to_one = [[0, 1]] * 40  # every assignment goes to shard 0's two experts
    sel = as_selection(all_to_one, experts)
    got = da.pooled_wave_dropped(sel, k, shards=shards, waves=waves, capacity_factor=1.15)
    assert (got.sender, got.receiver) == naive_pooled_wave(all_to_one, experts, k, shards, waves, 1.15)
    assert got.total > 0.5 * 80  # most of it cannot get through
    huge = da.pooled_wave_dropped(sel, k, shards=shards, waves=waves, capacity_factor=1e6)
    assert huge.total == 0
    with pytest.raises(ValueError, match="must divide the experts"):
        da.pooled_wave_dropped(sel, k, shards=3, waves=waves, capacity_factor=1.0)
    with pytest.raises(ValueError, match="must divide the tokens"):
        da.pooled_wave_dropped(sel, k, shards=4, waves=waves, capacity_factor=1.0, senders=3)


def test_pooled_wave_buffers_are_exact() -> None:
    # 1.15 · 1536 = 1766.4 exactly; (shards · waves) = 24 does not divide T·k.
    b = da.pooled_wave_buffers(192, 8, 8, 8, 3, 1.15)
    assert b.pool == math.ceil(Fraction(115, 100) * 1536 / 24) == 74
    assert b.slots == 74
    assert da.pooled_wave_buffers(192, 8, 8, 8, 3, 1.15, transport_capacity_factor=2.0).pool == 128


def test_a_layout_serves_every_capacity_factor() -> None:
    gen = torch.Generator().manual_seed(3)
    assignments = random_assignments(gen, 128, 16, 4, skew=1.2)
    sel = as_selection(assignments, 16)
    layout = da.wave_layout(sel, 4, 4, 3)
    for cf in (1.0, 1.15, 1.25, 1.5, 2.0):
        got = da.pooled_wave_dropped_from_layout(layout, cf)
        assert (got.sender, got.receiver) == naive_pooled_wave(assignments, 16, 4, 4, 3, cf)


def test_dropless_and_rate() -> None:
    sel = as_selection([[0, 1]] * 10, 4)
    assert da.dropless_dropped(sel) == 0
    assert da.drop_rate(5, 10, 2) == 0.25
    assert da.drop_rate(0, 0, 2) == 0.0
