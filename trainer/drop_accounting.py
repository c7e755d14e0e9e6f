"""Token-drop accounting: how many (token, expert) assignments a capacity rule would drop.

Pure functions on one micro-batch's routing *selection* (the router's top-k choice before any
dropping): a boolean tensor ``[tokens, experts]`` with exactly ``top_k`` True per row. The drop rate,
as the reference run defines it, is dropped assignments ÷ (tokens · k).

Three rules:

* **Megatron's per-micro-batch capacity** (``apply_router_token_dropping`` in Megatron-Core 0.16.1):
  every expert keeps at most ``ceil((T·k / E) · cf)`` of the micro-batch's T tokens, the rest of its
  assignments are dropped (which ones: by lowest probability, ``probs``, or latest position,
  ``position``; the *count* is the same for both);
* **pooled-wave expert parallelism** (the reference run's transport, ``../shared/reference``): the
  micro-batch's tokens are split into ``senders`` contiguous slices (sender ranks of Tₛ tokens) and
  the experts into ``shards`` destination shards of ``local_experts``; each sender's assignments for
  one destination go round-robin into ``waves`` waves, each wave's buffer ("pool") holding
  ``ceil(cf_transport · Tₛ·k / (shards · waves))`` (sender drops beyond it); at the destination each
  local expert has ``ceil(cf · Tₛ·k / (local_experts · waves))`` slots per wave (receiver drops
  beyond them). With fewer senders than shards (64-way expert parallelism accounted for from one
  rank's micro-batch) the slots are sized for the senders present:
  ``ceil(cf · senders · Tₛ·k / (experts · waves))``, the same formula when senders = shards;
* **dropless / ragged all-to-all**: no capacity, 0 by construction (the control).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch

DropPolicy = Literal["probs", "position"]


def megatron_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for one micro-batch, with Megatron's own float arithmetic (``get_capacity``:
    ``ceil((num_tokens / num_experts) * capacity_factor)`` with ``num_tokens = T·k``), so the
    counterfactual agrees bit for bit with what a run trained with that capacity drops."""
    return math.ceil(((tokens * top_k) / num_experts) * capacity_factor)


def capacity_dropped(selection: torch.Tensor, top_k: int, capacity_factor: float) -> int:
    """Assignments Megatron's capacity drops in this micro-batch: Σₑ max(0, cₑ − capacity)."""
    tokens, num_experts = selection.shape
    capacity = megatron_capacity(tokens, num_experts, top_k, capacity_factor)
    if capacity > tokens:  # Megatron skips dropping here; no expert can exceed T anyway
        return 0
    counts = selection.sum(dim=0)
    return int((counts - capacity).clamp(min=0).sum())


def capacity_keep_mask(
    selection: torch.Tensor,
    probs: torch.Tensor,
    top_k: int,
    capacity_factor: float,
    policy: DropPolicy = "probs",
) -> torch.Tensor:
    """Which assignments Megatron keeps (``[tokens, experts]`` bool): per expert the ``capacity``
    highest-probability (``probs``) or earliest (``position``) of its assignments."""
    tokens, num_experts = selection.shape
    capacity = megatron_capacity(tokens, num_experts, top_k, capacity_factor)
    if capacity >= tokens:
        return selection.clone()
    if policy == "probs":
        # Unselected entries rank below every selected one, whatever their probability.
        score = torch.where(selection, probs.float(), torch.full_like(probs, -1.0, dtype=torch.float32))
    elif policy == "position":
        order = torch.arange(tokens, 0, -1, device=selection.device, dtype=torch.float32).unsqueeze(1)
        score = torch.where(selection, order, torch.zeros(1, device=selection.device))
    else:
        raise ValueError(f"unknown drop policy {policy!r} (probs or position)")
    top = torch.topk(score, k=capacity, dim=0).indices
    within = torch.zeros_like(selection).scatter_(0, top, True)
    return selection & within


@dataclass(frozen=True)
class PooledWaveBuffers:
    """Buffer sizes per wave: a sender's pool per destination shard, a local expert's slots."""

    pool: int
    slots: int


def pooled_wave_buffers(
    tokens_per_sender: int,
    top_k: int,
    shards: int,
    local_experts: int,
    waves: int,
    capacity_factor: float,
    transport_capacity_factor: float | None = None,
    senders: int | None = None,
) -> PooledWaveBuffers:
    """``ceil(cf · Tₛ·k / (shards · waves))`` and ``ceil(cf · senders · Tₛ·k / (shards ·
    local_experts · waves))`` (= ``ceil(cf · Tₛ·k / (local_experts · waves))`` when senders = shards,
    the default).

    Exact rational arithmetic (cf as written in decimal): 1.15 · 1536 is 1766.4, not a float that
    rounds across an integer."""
    cf_transport = capacity_factor if transport_capacity_factor is None else transport_capacity_factor
    senders = shards if senders is None else senders
    assignments = tokens_per_sender * top_k
    pool = math.ceil(Fraction(str(cf_transport)) * assignments / (shards * waves))
    slots = math.ceil(
        Fraction(str(capacity_factor)) * senders * assignments / (shards * local_experts * waves)
    )
    return PooledWaveBuffers(pool=pool, slots=slots)


@dataclass(frozen=True)
class PooledWaveDrops:
    sender: int
    receiver: int

    @property
    def total(self) -> int:
        return self.sender + self.receiver


@dataclass(frozen=True)
class WaveLayout:
    """The capacity-free part of pooled-wave accounting for one selection and (shards, waves): each
    assignment's wave and its index inside that wave's pool. Computed once, then thresholded for
    every capacity factor of a sweep."""

    selection: torch.Tensor  # [senders, Tₛ, shards (destinations), local_experts] bool
    wave: torch.Tensor  # same shape, long: wave of each assignment (meaningful where selected)
    index_in_wave: torch.Tensor  # same shape, long: position inside its (sender, destination, wave) pool
    tokens_per_sender: int
    top_k: int
    waves: int


def wave_layout(
    selection: torch.Tensor, top_k: int, shards: int, waves: int, senders: int | None = None
) -> WaveLayout:
    """Split the micro-batch's tokens into ``senders`` contiguous slices (default: one per shard)
    and the experts into ``shards``; order each sender's assignments for one destination by (token,
    local expert) and deal them round-robin over waves."""
    tokens, num_experts = selection.shape
    senders = shards if senders is None else senders
    if shards < 1 or waves < 1 or senders < 1:
        raise ValueError(f"senders, shards and waves must be ≥ 1 (got {senders}, {shards}, {waves})")
    if num_experts % shards:
        raise ValueError(f"{shards} shards must divide the experts ({num_experts})")
    if tokens % senders:
        raise ValueError(f"{senders} senders must divide the tokens ({tokens})")
    local = num_experts // shards
    per_sender = tokens // senders
    sel = selection.reshape(senders, per_sender, shards, local)
    # Assignment order inside one (sender, destination): token-major, then local expert.
    flat = sel.permute(0, 2, 1, 3).reshape(senders, shards, per_sender * local).long()
    position = flat.cumsum(dim=-1) - 1  # 0-based index among this destination's assignments
    wave = (position % waves).reshape(senders, shards, per_sender, local).permute(0, 2, 1, 3)
    index = (position // waves).reshape(senders, shards, per_sender, local).permute(0, 2, 1, 3)
    return WaveLayout(sel, wave, index, per_sender, top_k, waves)


def pooled_wave_dropped_from_layout(
    layout: WaveLayout, capacity_factor: float, transport_capacity_factor: float | None = None
) -> PooledWaveDrops:
    senders, _, shards, local = layout.selection.shape
    buffers = pooled_wave_buffers(
        layout.tokens_per_sender,
        layout.top_k,
        shards,
        local,
        layout.waves,
        capacity_factor,
        transport_capacity_factor,
        senders,
    )
    sel = layout.selection
    sent = sel & (layout.index_in_wave < buffers.pool)
    sender_drops = int(sel.sum()) - int(sent.sum())
    # Arrivals per (destination, local expert, wave), summed over senders and tokens.
    one_hot = torch.nn.functional.one_hot(layout.wave.clamp(min=0), layout.waves) & sent.unsqueeze(-1)
    arrivals = one_hot.sum(dim=(0, 1))  # [destinations, local_experts, waves]
    receiver_drops = int((arrivals - buffers.slots).clamp(min=0).sum())
    return PooledWaveDrops(sender=sender_drops, receiver=receiver_drops)


def pooled_wave_dropped(
    selection: torch.Tensor,
    top_k: int,
    *,
    shards: int,
    waves: int,
    capacity_factor: float,
    transport_capacity_factor: float | None = None,
    senders: int | None = None,
) -> PooledWaveDrops:
    """Sender and receiver drops of pooled-wave expert parallelism for one micro-batch."""
    layout = wave_layout(selection, top_k, shards, waves, senders)
    return pooled_wave_dropped_from_layout(layout, capacity_factor, transport_capacity_factor)


def dropless_dropped(selection: torch.Tensor) -> int:
    """Ragged all-to-all / dropless MoE: every assignment reaches its expert."""
    return 0


def drop_rate(dropped: int, tokens: int, top_k: int) -> float:
    """Dropped assignments ÷ (tokens · k), the reference run's definition."""
    return dropped / (tokens * top_k) if tokens > 0 else 0.0
