"""How often an honest row would exceed NOISE_FLOOR_FACTOR x the plain loop's noise floor, simulated from GPU rows.

    python scripts/parity_noise_floor.py results/reference/h200/a3663fd/rows.jsonl
    python scripts/parity_noise_floor.py ROWS.jsonl --workload gpt2-small --precision bf16 --trials 100000

Where the factor of harness.derive.parity comes from (its docstring). From one set of GPU rows at world size 1, where
DDP, FSDP2 and Horovod compute exactly the plain loop's arithmetic and differ from it only by the device's run-to-run
noise, each tensor's noise is estimated as sigma_t = rms over those rows of (x_t - plain_t) / plain_t, / sqrt(2) (two
noisy launches in each difference). Then, for each tensor-by-tensor quantity, trials draw independent launches with
that noise: a reference, 1 or 2 more plain launches (the floor: the largest of their deviations from the reference,
over tensors) and an honest row (its largest deviation), and count how often the row exceeds k x the floor.

The noise is taken as normal and independent between tensors, launches and trials: GPU non-determinism (atomics in a
backward kernel) is neither, so the figures say how the rule behaves on noise of this size and spread across tensors,
not how often it will fail on a given GPU. Prints one line per quantity, floor launches and factor.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SAME_ARITHMETIC = ("ddp", "fsdp2", "horovod")
QUANTITIES = ("gradient_norm_by_tensor_first_step", "update_norm_by_tensor_first_step")


def noise_by_tensor(rows: list[dict], workload: str, precision: str, quantity: str) -> np.ndarray:
    """sigma_t of each tensor, from the same-arithmetic rows' deviations from the plain loop's first launch."""
    def measurements(strategy: str) -> dict:
        return next(r["measurements"] for r in rows if r["status"] == "ok" and not r["spec"].get("options")
                    and (r["spec"]["workload"], r["spec"]["strategy"], r["spec"]["precision"]) ==
                    (workload, strategy, precision) and r["spec"]["world_size"] == 1)

    plain = measurements("plain")[quantity]
    names = sorted(plain)
    deviations = np.array([[(measurements(s)[quantity][n] - plain[n]) / plain[n] for n in names]
                           for s in SAME_ARITHMETIC])
    return np.sqrt((deviations ** 2).mean(axis=0) / 2)


def false_alarms(sigma: np.ndarray, floor_launches: int, factor: float, trials: int, seed: int = 0) -> float:
    """The share of trials in which an honest row's largest deviation exceeds factor x the floor."""
    rng = np.random.default_rng(seed)
    launches = rng.normal(size=(trials, floor_launches + 2, sigma.size)) * sigma   # reference, floor launches, row
    reference = launches[:, :1]
    floor = np.abs(launches[:, 1:-1] - reference).max(axis=2).max(axis=1)
    row = np.abs(launches[:, -1] - reference[:, 0]).max(axis=1)
    return float((row > factor * floor).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path)
    parser.add_argument("--workload", default="gpt2-small")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--trials", type=int, default=100_000)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    for quantity in QUANTITIES:
        sigma = noise_by_tensor(rows, args.workload, args.precision, quantity)
        print(f"{quantity}: {sigma.size} tensors, sigma largest {sigma.max():.2g}, second {np.sort(sigma)[-2]:.2g}, "
              f"{int((sigma == 0).sum())} repeat exactly")
        for floor_launches in (1, 2):
            for factor in (4, 10, 20):
                share = false_alarms(sigma, floor_launches, factor, args.trials)
                print(f"  plain launches {floor_launches + 1}, factor {factor:>2}: honest row beyond it in "
                      f"{share:.3%} of {args.trials} trials")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
