"""A plain PyTorch loop (no Megatron) recording into runledger: a tiny top-2 mixture-of-experts
regressor with a capacity limit, so it has router statistics to report.

    python examples/torch_loop.py --steps 40 --run-id torch-demo
    ledger ingest spool && ledger state torch-demo && ledger query "SELECT step, value FROM metrics WHERE name = 'loss'"

Each logged step is also printed as one JSON line (what was logged), so a test can compare.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import runledger

EXPERTS, TOP_K, LAYERS, WIDTH = 4, 2, 2, 16


class MoELayer(torch.nn.Module):
    """Top-k routing with a per-expert capacity: assignments over capacity are dropped."""

    def __init__(self, capacity_factor: float) -> None:
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        probs = torch.softmax(self.router(x), dim=-1)
        weight, chosen = torch.topk(probs, TOP_K, dim=-1)
        capacity = math.ceil(self.capacity_factor * x.shape[0] * TOP_K / EXPERTS)
        onehot = torch.nn.functional.one_hot(chosen, EXPERTS).flatten(0, 1)  # (tokens·k) × experts
        position = onehot.cumsum(0) * onehot  # 1-based place of each assignment in its expert's queue
        kept = ((position > 0) & (position <= capacity)).reshape(x.shape[0], TOP_K, EXPERTS)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (kept[..., e] * weight).sum(-1, keepdim=True)
            out = out + gate * expert(x)
        counts = kept.sum(dim=(0, 1)).float()
        chosen_share = onehot.sum(0).float() / onehot.shape[0]
        stats = {
            "counts": counts,
            "drop": 1 - counts.sum() / (x.shape[0] * TOP_K),
            "aux_loss": EXPERTS * (chosen_share * probs.mean(0)).sum(),
            "entropy": torch.special.entr(probs).sum(-1).mean(),
        }
        return x + out, stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    config = {"lr": 0.02, "batch": 64, "capacity_factor": 1.0, "layers": LAYERS, "experts": EXPERTS}
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(MoELayer(config["capacity_factor"]) for _ in range(LAYERS))
    head = torch.nn.Linear(WIDTH, 1)
    params = [*layers.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=config["lr"])
    target = torch.randn(WIDTH, 1)

    with runledger.init(args.run_id, config=config, name="plain pytorch moe") as run:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            x = torch.randn(config["batch"], WIDTH)
            h, per_layer = x, []
            for layer in layers:
                h, stats = layer(h)
                per_layer.append(stats)
            loss = torch.nn.functional.mse_loss(head(h), x @ target)
            if not run.check_finite(loss, step=step, policy="skip"):
                optimizer.zero_grad()
                continue
            optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            if step == args.steps // 2:  # a live change, recorded with its cause
                config["lr"] = config["lr"] / 2
                for group in optimizer.param_groups:
                    group["lr"] = config["lr"]
                run.config.update({"lr": config["lr"]}, cause="halve lr at mid-run", step=step + 1)
            # Tensors go in as they are: one device-to-host copy per call.
            run.log({"loss": loss.detach(), "grad_norm": grad_norm, "lr": config["lr"]}, step=step)
            run.log_router(
                step,
                counts=torch.stack([s["counts"] for s in per_layer]),
                drop=torch.stack([s["drop"] for s in per_layer]),
                aux_loss=torch.stack([s["aux_loss"] for s in per_layer]).detach(),
                entropy=torch.stack([s["entropy"] for s in per_layer]).detach(),
                top_k=TOP_K,
            )
            run.log_rank({"step_wall_ms": 1000 * (time.perf_counter() - t0)}, step=step)
            if args.checkpoint_dir and step % 10 == 0:
                path = f"{args.checkpoint_dir}/step{step}.pt"
                torch.save({"layers": layers.state_dict(), "head": head.state_dict()}, path)
                run.checkpoint(step, path)
            record = {"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(), "lr": config["lr"]}
            print(json.dumps(record), flush=True)
    print(json.dumps({"run_id": run.run_id, "attempt": run.attempt}), flush=True)


if __name__ == "__main__":
    main()
