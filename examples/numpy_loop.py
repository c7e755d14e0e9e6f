"""A NumPy loop recording into runledger: linear regression by SGD, no deep-learning framework.

    python examples/numpy_loop.py --steps 50 --run-id numpy-demo
    ledger ingest spool && ledger state numpy-demo

Each logged step is also printed as one JSON line (what was logged), so a test can compare.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import runledger


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    config = {"lr": 0.05, "batch": 32, "features": 8, "optimizer": {"name": "sgd", "momentum": 0.0}}
    true_w = rng.normal(size=config["features"])
    w = np.zeros(config["features"])

    run = runledger.init(args.run_id, config=config, name="numpy linear regression")
    with run:
        for step in range(1, args.steps + 1):
            x = rng.normal(size=(config["batch"], config["features"]))
            y = x @ true_w + 0.1 * rng.normal(size=config["batch"])
            residual = x @ w - y
            loss = np.mean(residual**2)  # a NumPy scalar: logged as it is
            grad = 2 * x.T @ residual / config["batch"]
            w -= config["lr"] * grad
            values = {
                "loss": loss,
                "grad_norm": np.linalg.norm(grad),
                "lr": config["lr"],
                "eval": {"w_err": np.linalg.norm(w - true_w)},
            }
            run.log(values, step=step)
            if step == 25:
                run.config.update({"lr": 0.02}, cause="lower lr after warm phase", step=step + 1)
                config["lr"] = 0.02
                run.annotate("lr lowered by hand", step=step)
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": float(loss),
                        "grad_norm": float(np.linalg.norm(grad)),
                        "lr": values["lr"],
                        "eval/w_err": float(values["eval"]["w_err"]),
                    }
                ),
                flush=True,
            )
    print(json.dumps({"run_id": run.run_id, "attempt": run.attempt}), flush=True)


if __name__ == "__main__":
    main()
