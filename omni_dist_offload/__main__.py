"""``python -m omni_dist_offload``: stream the built-in tiny Wan pipeline and check it.

Runs the pipeline resident, then with its DiT and text encoder streamed block by block, and
checks that the videos are bitwise equal. Runs anywhere (CPU or one GPU) in seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from . import apply_offload
from .tiny import BUILTIN_PIPELINE_DEFAULTS, BUILTIN_PIPELINES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_dist_offload", description=__doc__)
    parser.add_argument("--model", default="tiny-wan", choices=sorted(BUILTIN_PIPELINES))
    parser.add_argument("--prompt", default="a red fox running through snow")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def run(pipe):
        out = pipe(prompt=args.prompt, generator=torch.Generator().manual_seed(args.seed),
                   output_type="pt", **BUILTIN_PIPELINE_DEFAULTS[args.model])
        return out.frames if hasattr(out, "frames") else out.images

    build = BUILTIN_PIPELINES[args.model]
    reference = run(build().to(device))
    pipe = build()
    handle = apply_offload(pipe, {"mode": "layer", "components": ["dit", "text_encoder"]}, device=device)
    streamed = run(pipe)
    print(f"{'component':<16}{'class':<28}{'blocks':>7}{'block MiB':>11}{'transfer':>12}")
    for row in handle.summary():
        print(f"{row['component']:<16}{row['module_class']:<28}{row['num_blocks']:>7}"
              f"{row['block_bytes'] / 2**20:>11.2f}{row['weight_transfer']:>12}")
    equal = torch.equal(streamed.cpu(), reference.cpu())
    print(f"{args.model} on {device}: output shape {tuple(streamed.shape)}, "
          f"bitwise equal to resident: {equal}")
    handle.remove()
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
